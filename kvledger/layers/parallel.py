"""Tensor-parallel projections: column-parallel (output rows split), row-parallel (input columns
split, one all-reduce), and the head-aware q/k/v split (:mod:`kvledger.spec.head_split`).

Each class is a :class:`~kvledger.layers.linear.Linear` holding only this rank's slice, so the
prepacked CPU path applies to the slice unchanged. ``shard(pieces)`` turns the checkpoint's
full tensors (the pieces a fused projection concatenates, e.g. q, k and v) into this rank's
slice of the fused weight or bias; the model's loader calls it. At TP 1 every slice is the
whole tensor and these layers compute exactly what :class:`Linear` does.

The pairing that needs one all-reduce per block (Megatron's): q/k/v and gate/up are
column-parallel, so each rank computes whole heads and whole MLP columns without talking to
the others; o and down are row-parallel, each rank's partial product summed over the ranks.
"""

from __future__ import annotations

import torch

from kvledger.distributed.parallel_state import all_reduce, tp_rank, tp_size
from kvledger.errors import KVLedgerError
from kvledger.layers.linear import Linear, linear
from kvledger.spec.head_split import split_heads


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise KVLedgerError(f"tensor-parallel size {parts} does not divide the {n} {what}; choose a divisor of {n}")
    return n // parts


class ColumnParallelLinear(Linear):
    """``y_local = x W_local^T + b_local``: this rank's share of each of ``output_sizes``'s
    pieces (``[sum(output_sizes) / TP, in]``), the pieces concatenated as the fused weight is."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.output_sizes = [_divide(n, self.tp_size, "output features") for n in output_sizes]
        super().__init__(in_features, sum(self.output_sizes), bias=bias)

    def shard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's rows of each full piece (``[n_i, ...]``), concatenated."""
        rows = [p.narrow(0, self.tp_rank * n, n) for p, n in zip(pieces, self.output_sizes)]
        return rows[0] if len(rows) == 1 else torch.cat(rows, 0)


class QKVParallelLinear(Linear):
    """The fused q/k/v projection split by heads, by the one rule planner and engine share
    (:mod:`kvledger.spec.head_split`): this rank's query heads and the KV heads of their groups
    (whole GQA groups, unevenly when TP does not divide ``H_kv``; one KV head copied to
    ``TP / H_kv`` ranks when TP exceeds ``H_kv``)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.heads = split_heads(num_heads, num_kv_heads, self.tp_size, "the model").ranks[self.tp_rank]
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads  # this rank's
        super().__init__(hidden, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias=bias)

    @property
    def q_features(self) -> tuple[int, int]:
        """(first, count) of the attention output features this rank computes: its query heads'
        ``head_dim`` columns each, the input columns of the row-parallel o projection."""
        return self.heads.q_start * self.head_dim, self.num_heads * self.head_dim

    def shard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's rows of the full q, k and v weights (or biases), concatenated."""
        q, k, v = pieces
        d, h = self.head_dim, self.heads
        return torch.cat((q.narrow(0, h.q_start * d, h.num_heads * d), k.narrow(0, h.kv_start * d, h.num_kv_heads * d),
                          v.narrow(0, h.kv_start * d, h.num_kv_heads * d)), 0)


class RowParallelLinear(Linear):
    """``y = sum over ranks of x_local W_local^T``, then ``+ b + residual`` once: this rank holds
    columns ``[in / TP]`` of the weight, or the ``in_features_slice`` (first, count) it is given
    (an attention output split by :attr:`QKVParallelLinear.q_features`), and receives that share
    of the input features (what the column-parallel layer before it produced)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 in_features_slice: tuple[int, int] | None = None) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if in_features_slice is None:
            self.in_local = _divide(in_features, self.tp_size, "input features")
            self.in_start = self.tp_rank * self.in_local
        else:
            self.in_start, self.in_local = in_features_slice
        super().__init__(self.in_local, out_features, bias=bias)

    def shard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's columns of the full weight ``[out, in]``; a bias ``[out]`` is kept whole."""
        (full,) = pieces
        if full.dim() == 1:
            return full
        return full.narrow(1, self.in_start, self.in_local)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if self.tp_size == 1:
            return super().forward(x, residual)
        y = all_reduce(linear(x, self.weight, None, self.kernel_weight))
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else y + residual


def rank_slice(model: torch.nn.Module, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """What parameter ``name`` of ``model`` takes from the checkpoint's full ``pieces``: this rank's
    slice when its module is a parallel projection (``shard``), else the pieces concatenated."""
    module = model.get_submodule(name.rpartition(".")[0])
    if hasattr(module, "shard"):
        return module.shard(pieces)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
