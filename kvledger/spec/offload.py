"""The second KV tier's size in blocks: vLLM's arithmetic for ``--kv-offloading-size GiB``.

vLLM 0.32 (``config/vllm.py``, ``_post_init_kv_transfer_config``) turns the flag into
``cpu_bytes_to_use = kv_offloading_size * 2**30`` bytes, summed over the tensor-parallel ranks.
Its CPU offloading spec (``v1/kv_offload/cpu/spec.py``) then sizes the tier in *chunks* of
``blocks_per_chunk`` GPU blocks (1 unless the connector's ``block_size`` says otherwise; the
flag leaves it at 1, so a tier-2 block is a tier-1 block):

* a rank's block bytes are its pool's bytes over its blocks
  (``distributed/kv_transfer/kv_connector/v1/offloading/config.py``: one page per layer of
  the group, scales included);
* the tier keeps one copy per rank (``world_size`` copies), or one in all for an MLA latent
  that every rank of a tensor-parallel group holds alike (its "replicated layout");
* each chunk is rounded up to the host page (``mmap.PAGESIZE``, 4,096 bytes on x86-64 Linux);
* chunks = ``int(cpu_bytes_to_use) // aligned chunk bytes``.

Torch-free: ``kvledger plan`` prints it, ``kvledger simulate`` sizes its tier with it, and the
engine allocates exactly that many blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import KVLedgerError

GIB = 1 << 30
"""Bytes per GiB: vLLM's ``--kv-offloading-size`` is in GiB (2^30 bytes), not GB."""
HOST_PAGE_BYTES = 4096
"""The host page (``mmap.PAGESIZE`` on x86-64 Linux) each tier-2 block is rounded up to."""


@dataclass(frozen=True)
class OffloadCapacity:
    """The tier vLLM would allocate for ``size_gib``: ``num_blocks`` blocks of ``block_size``
    tokens, each ``slot_bytes`` bytes of host memory (``block_bytes`` of K/V and scales for
    every copy, rounded up to the host page)."""

    size_gib: float
    budget_bytes: int
    """``int(size_gib * 2**30)``: the bytes the flag grants, all ranks together."""
    block_size: int
    block_bytes: int
    """One block's K/V bytes in the tier, every copy (rank) included."""
    slot_bytes: int
    """``block_bytes`` rounded up to :data:`HOST_PAGE_BYTES`."""
    num_blocks: int
    copies: int
    """Ranks whose block bytes the tier keeps (1 for a replicated MLA latent)."""

    @property
    def num_tokens(self) -> int:
        """Tokens the tier holds: ``num_blocks x block_size``."""
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        """Host bytes the tier's slots take: ``num_blocks x slot_bytes`` (at most ``budget_bytes``)."""
        return self.num_blocks * self.slot_bytes

    @property
    def rank_block_bytes(self) -> int:
        """One block's bytes on one rank: what one rank's host link carries per block moved."""
        return self.block_bytes // self.copies


def offload_capacity(size_gib: float, rank_block_bytes: int, block_size: int, tensor_parallel_size: int = 1,
                     replicated: bool = False) -> OffloadCapacity:
    """The tier for ``--kv-offloading-size size_gib``: ``rank_block_bytes`` is one tier-1 block
    on one rank, scales included (:meth:`kvledger.spec.kv_bytes.KVBytes.page_bytes`);
    ``replicated``: every rank holds the same block (an MLA latent under tensor parallelism)."""
    if not size_gib > 0:
        raise KVLedgerError(f"--kv-offloading-size must be a positive number of GiB, got {size_gib:g}")
    if rank_block_bytes < 1 or block_size < 1 or tensor_parallel_size < 1:
        raise ValueError(f"block of {rank_block_bytes} bytes and {block_size} tokens, TP {tensor_parallel_size}")
    copies = 1 if replicated and tensor_parallel_size > 1 else tensor_parallel_size
    block_bytes = rank_block_bytes * copies
    slot_bytes = -(-block_bytes // HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    budget = int(size_gib * GIB)
    return OffloadCapacity(size_gib=size_gib, budget_bytes=budget, block_size=block_size, block_bytes=block_bytes,
                           slot_bytes=slot_bytes, num_blocks=budget // slot_bytes, copies=copies)


def tier_capacity(spec, kv_cache_dtype: str, block_size: int, size_gib: float,
                  tensor_parallel_size: int = 1) -> OffloadCapacity:
    """:func:`offload_capacity` for a model: its blocks of ``block_size`` tokens in ``kv_cache_dtype``
    on each of ``tensor_parallel_size`` ranks (:meth:`~kvledger.spec.kv_bytes.KVBytes.page_bytes`,
    scales included), an MLA latent kept once. Refused in one line for a model whose layers do not
    all keep every token (sliding windows, recurrent state), and for a size that holds no block."""
    from kvledger.spec.kv_bytes import kv_bytes

    if spec.is_hybrid or spec.num_sliding_layers:
        raise KVLedgerError(f"{spec.name}: a KV offloading tier is not supported for models with sliding-window "
                            "or recurrent-state layers")
    rank_block = kv_bytes(spec, kv_cache_dtype, tensor_parallel_size=tensor_parallel_size).page_bytes(block_size)
    capacity = offload_capacity(size_gib, rank_block, block_size, tensor_parallel_size, replicated=spec.is_mla)
    if capacity.num_blocks < 1:
        raise KVLedgerError(f"--kv-offloading-size {size_gib:g} GiB holds no block of {capacity.slot_bytes:,} bytes")
    return capacity
