"""Tensor-parallel projections: column-parallel (output rows split), row-parallel (input columns
split, one all-reduce), and the head-aware q/k/v split.

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


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection split by heads: ``H / TP`` query heads per rank and
    ``max(1, H_kv / TP)`` KV heads, a KV head copied to ``TP / H_kv`` ranks when TP exceeds
    ``H_kv`` (rank ``r`` then holds KV head ``r // (TP / H_kv)``, the one its query heads use)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = tp_size()
        if num_kv_heads % tp and tp % num_kv_heads:
            raise KVLedgerError(f"tensor-parallel size {tp} cannot split {num_kv_heads} KV heads: it must divide "
                                f"them or be a multiple of them")
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_head_start = (tp_rank() * num_kv_heads // tp) if num_kv_heads >= tp else tp_rank() // (tp // num_kv_heads)
        q, kv = num_heads * head_dim, self.num_kv_heads * head_dim * tp  # kv: as if each rank had its own heads
        super().__init__(hidden, [q, kv, kv], bias)

    def shard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = pieces
        d = self.head_dim
        q_rows = q.narrow(0, self.tp_rank * self.num_heads * d, self.num_heads * d)
        k_rows = k.narrow(0, self.kv_head_start * d, self.num_kv_heads * d)
        v_rows = v.narrow(0, self.kv_head_start * d, self.num_kv_heads * d)
        return torch.cat((q_rows, k_rows, v_rows), 0)


class RowParallelLinear(Linear):
    """``y = sum over ranks of x_local W_local^T``, then ``+ b + residual`` once: this rank holds
    columns ``[in / TP]`` of the weight and receives its share of the input features (what the
    column-parallel layer before it produced)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.in_local = _divide(in_features, self.tp_size, "input features")
        super().__init__(self.in_local, out_features, bias=bias)

    def shard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's columns of the full weight ``[out, in]``; a bias ``[out]`` is kept whole."""
        (full,) = pieces
        if full.dim() == 1:
            return full
        return full.narrow(1, self.tp_rank * self.in_local, self.in_local)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if self.tp_size == 1:
            return super().forward(x, residual)
        y = all_reduce(linear(x, self.weight, None, self.kernel_weight))
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else y + residual
