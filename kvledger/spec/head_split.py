"""How tensor-parallel ranks share a model's attention heads: the one rule, for planner and engine.

Counts below are heads (query or KV); ``TP`` is the tensor-parallel size.

* **TP <= H_kv: whole GQA groups.** Rank ``r`` takes a contiguous run of KV heads and the query
  heads of exactly those groups (``H / H_kv`` each), so no rank needs another's K or V. When
  ``TP`` divides ``H_kv`` every rank gets ``H_kv / TP`` (vLLM's split). When it does not, the
  first ``H_kv % TP`` ranks take one KV head more than the others: SmolLM2-135M's 3 KV heads
  at TP 2 are 2 and 1 (6 and 3 query heads). vLLM refuses such a size (so the planner's vLLM
  memory wall does, ``even=True``); kvledger's engine runs it, and every rank keeps the same
  number of blocks, so a pool is sized by the largest rank (rank 0): :attr:`HeadSplit.max_kv_heads`.
* **TP > H_kv: replicated KV heads** (vLLM's rule), when ``TP`` is a multiple of ``H_kv`` and
  divides ``H``: each rank holds one KV head, copied to ``TP / H_kv`` ranks, and ``H / TP`` of
  its query heads (Gemma-3 270M's 1 KV head at TP 2).
* **MLA**: the latent is replicated on every rank; ``TP`` must divide ``H``.

Any other size is refused by :func:`split_heads` in one line naming the sizes that work.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import KVLedgerError


@dataclass(frozen=True)
class RankHeads:
    """One rank's heads: query heads ``[q_start, q_start + num_heads)`` and KV heads
    ``[kv_start, kv_start + num_kv_heads)`` of the full model (an MLA latent: ``0, 1``)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


@dataclass(frozen=True)
class HeadSplit:
    """The heads of ``num_heads`` query heads over ``num_kv_heads`` KV heads on each of
    ``tensor_parallel_size`` ranks; ``kind`` is ``"groups"`` (whole GQA groups per rank, even or
    not), ``"replicated"`` (one KV head copied to several ranks) or ``"latent"`` (MLA)."""

    num_heads: int
    num_kv_heads: int
    tensor_parallel_size: int
    kind: str
    ranks: tuple[RankHeads, ...]

    @property
    def max_kv_heads(self) -> int:
        """KV heads of the largest rank (rank 0): what each rank's pool is sized by."""
        return max(r.num_kv_heads for r in self.ranks)

    @property
    def even(self) -> bool:
        """Every rank holds as many query and KV heads as every other (the splits vLLM runs)."""
        return len({(r.num_heads, r.num_kv_heads) for r in self.ranks}) == 1


def head_split(num_heads: int, num_kv_heads: int, tp: int, latent: bool = False) -> HeadSplit | None:
    """The split of the module's rule, or None when ``tp`` ranks cannot share these heads.
    ``latent``: an MLA model (``num_kv_heads`` is then ignored)."""
    if latent:
        if num_heads % tp:
            return None
        q = num_heads // tp
        return HeadSplit(num_heads, num_kv_heads, tp, "latent", tuple(RankHeads(r * q, q, 0, 1) for r in range(tp)))
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return None
    group = num_heads // num_kv_heads  # query heads per KV head
    if tp <= num_kv_heads:
        base, extra = divmod(num_kv_heads, tp)
        starts = [r * base + min(r, extra) for r in range(tp + 1)]
        ranks = tuple(RankHeads(starts[r] * group, (starts[r + 1] - starts[r]) * group, starts[r],
                                starts[r + 1] - starts[r]) for r in range(tp))
        return HeadSplit(num_heads, num_kv_heads, tp, "groups", ranks)
    if tp % num_kv_heads or num_heads % tp:
        return None
    copies, q = tp // num_kv_heads, num_heads // tp
    return HeadSplit(num_heads, num_kv_heads, tp, "replicated",
                     tuple(RankHeads(r * q, q, r // copies, 1) for r in range(tp)))


def split_heads(num_heads: int, num_kv_heads: int, tp: int, model: str, latent: bool = False,
                even: bool = False) -> HeadSplit:
    """:func:`head_split`, or a one-line KVLedgerError naming the sizes that work for ``model``.
    ``even``: only a split that gives every rank as many heads as every other, the sizes vLLM
    runs (the planner's memory wall is vLLM's); an uneven one is refused naming both lists."""
    split = head_split(num_heads, num_kv_heads, tp, latent)
    if split is not None and (split.even or not even):
        return split
    if latent:
        heads, rule = f"{num_heads} attention heads", "the attention heads must divide evenly"
    else:
        heads = f"{num_heads} attention heads and {num_kv_heads} KV heads"
        rule = ("a rank takes whole KV-head groups, or the size is a multiple of the KV heads that divides "
                "the attention heads")
    sizes = [n for n in range(1, num_heads + 1) if head_split(num_heads, num_kv_heads, n, latent)]
    if not even:
        raise KVLedgerError(f"tensor-parallel size {tp} cannot split the {heads} of {model} ({rule}); "
                            f"sizes that do: {', '.join(map(str, sizes))}")
    vllm = [n for n in sizes if head_split(num_heads, num_kv_heads, n, latent).even]
    engine = [n for n in sizes if n not in vllm]
    also = f"; kvledger's engine also runs {', '.join(map(str, engine))} (whole KV-head groups, unevenly)"
    raise KVLedgerError(f"tensor-parallel size {tp} cannot split the {heads} of {model} evenly, as vLLM requires; "
                        f"sizes that do: {', '.join(map(str, vllm))}{also if engine else ''}")
