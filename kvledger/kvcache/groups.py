"""KV-cache groups: which layers share one block table per request.

A model whose layers all attend the same way has one group of every layer. A hybrid (Gemma-3's
sliding and full layers) has one group per run of ``g`` layers of one attention type, all paged
from the one block pool; a sliding group keeps only the blocks its window still reaches. The
models declare their groups (:func:`kv_cache_groups`), the manager keeps one table per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvledger.spec.kv_bytes import first_kept_block, kv_group_sizes

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
NULL_BLOCK = -1
"""A sliding-window table's entry for a block it gave back (its tokens left the window)."""


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request: their ``attention`` type, the model's layer
    indices, and the ``sliding_window`` in tokens (None for full attention)."""

    attention: str
    layers: tuple[int, ...]
    sliding_window: int | None = None


def kv_cache_groups(layer_types: Sequence[str], sliding_window: int | None) -> list[KVCacheGroup]:
    """vLLM's grouping: each attention type's layers, in order, cut into groups of ``g`` layers,
    ``g`` the smallest count of any type (one type: one group of every layer). The last group of
    a type may hold fewer layers; its pages are paid for in full (:func:`vllm_page_layers`)."""
    by_type: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_types):
        by_type.setdefault(FULL_ATTENTION if kind == FULL_ATTENTION else SLIDING_ATTENTION, []).append(i)
    if len(by_type) == 1:
        kind, layers = next(iter(by_type.items()))
        return [KVCacheGroup(kind, tuple(layers), sliding_window if kind == SLIDING_ATTENTION else None)]
    size, _, _ = kv_group_sizes(len(by_type[FULL_ATTENTION]), len(by_type[SLIDING_ATTENTION]))
    groups = []
    for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
        layers = by_type[kind]
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroup(kind, tuple(layers[start:start + size]),
                                       sliding_window if kind == SLIDING_ATTENTION else None))
    return groups


def first_live_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """Index of the first block a group keeps for a request with ``num_tokens`` computed tokens:
    0 for full attention, else the block holding the first of the last ``window`` tokens (the
    planner's arithmetic, :func:`kvledger.spec.kv_bytes.first_kept_block`)."""
    return first_kept_block(num_tokens, window, block_size)


def request_blocks(groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, chunk_tokens: int) -> int:
    """The most blocks one request of ``num_tokens`` tokens can hold at once, over every group: all
    of its blocks in a full group; in a sliding group its window plus the largest prefill chunk
    (``chunk_tokens``), and one more for a window that does not start at a block's edge."""
    blocks = -(-num_tokens // block_size)
    return sum(blocks if g.sliding_window is None
               else min(blocks, -(-(g.sliding_window + chunk_tokens) // block_size) + 1) for g in groups)


def longest_fitting(groups: Sequence[KVCacheGroup], max_tokens: int, num_blocks: int, block_size: int,
                    chunk_tokens: int) -> int:
    """The longest request (at most ``max_tokens`` tokens) whose blocks always fit ``num_blocks``."""
    lo, hi = 0, max_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if request_blocks(groups, mid, block_size, chunk_tokens) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
