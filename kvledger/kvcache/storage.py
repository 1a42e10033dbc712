"""The paged KV cache: the only code that writes to or reads from the block pool tensors.

Layout: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
(``2`` = K and V). Physical slot ``s`` of a layer is block ``s // block_size``, offset
``s % block_size``. Its size is exactly Eq 2.2: ``2 * L * H_kv * d_h * s`` bytes per token
times ``num_blocks * block_size`` tokens.

Quantized storage (int8/fp8 with scales, :mod:`kvledger.kvcache.quantized_storage`) overrides the
same methods: :meth:`KVCache.write` quantizes, :meth:`KVCache.gather` dequantizes,
:meth:`KVCache.gather_decode` hands attention the 8-bit values widened but unscaled, with the
scales beside them, and :meth:`KVCache.layer_pools` hands the in-place kernels a layer's pools as
stored, with their scales. Callers never touch :attr:`KVCache.storage`.
"""

from __future__ import annotations

import math
import mmap
import sys
from dataclasses import dataclass

import torch

from kvledger.errors import KVLedgerError
from kvledger.spec.dtypes import DTYPE_ALIASES, STORAGE_DTYPES

def torch_dtype(name: str) -> torch.dtype:
    """The one mapping from a dtype name to torch: a ``--dtype`` value or alias, or an engine
    ``--kv-cache-dtype`` (its stored element, :data:`kvledger.spec.dtypes.STORAGE_DTYPES`); a
    one-line error when this torch lacks it (the float8 types on an old torch)."""
    attr = STORAGE_DTYPES.get(DTYPE_ALIASES.get(name, name))
    if attr is None:
        raise KVLedgerError(f"dtype {name!r} is not one the engine stores; use one of {', '.join(STORAGE_DTYPES)}")
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise KVLedgerError(f"--kv-cache-dtype {name} needs torch.{attr}, which this torch {torch.__version__} "
                            f"lacks; upgrade torch or use --kv-cache-dtype int8")
    return dtype


@dataclass
class DecodeKV:
    """K and V for decode attention, ``[B, H_kv, T, d_h]`` in the compute dtype, before their
    scales: the real keys are ``k * k_scale`` and the real values ``v * v_scale``.

    A scale is a float (one per layer, or 1.0 for an unquantized cache) or a per-token,
    per-head tensor ``[B, H_kv, T]``. Attention applies them to the scores and to the
    probabilities, which are ``d_h`` times smaller than K and V."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | float = 1.0
    v_scale: torch.Tensor | float = 1.0

    @property
    def has_scales(self) -> bool:
        """True when scales remain to apply (False: K and V are the real keys and values)."""
        return not (isinstance(self.k_scale, float) and isinstance(self.v_scale, float)
                    and self.k_scale == 1.0 and self.v_scale == 1.0)


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor for block pools. On a Linux CPU it lies in memory of its own (an anonymous
    private mapping) that is advised to be backed by transparent huge pages
    (``madvise(MADV_HUGEPAGE)``) before any page of it is touched; where THP is ``madvise``-only,
    as on many servers, nothing else gets them.

    Decode attention reads 16-token blocks scattered over the pool: with 4 KiB pages nearly
    every block misses the TLB, with 2 MiB pages few do. SmolLM2's decode attention over 24
    sequences of 400 tokens, blocks scattered in a 1 GiB pool, 2 threads, AMD EPYC (Zen 4): float32
    988 -> 866 us a layer, bfloat16 856 -> 703 us. torch's allocator has the same advice behind
    ``THP_MEM_ALLOC_ENABLE=1``, but reads it once, when torch is imported, and for every large
    tensor of the process; and memory that malloc hands back from its heap may be in small pages
    already, which the advice does not change."""
    count = math.prod(shape)
    if (count == 0 or torch.device(device).type != "cpu" or not sys.platform.startswith("linux")
            or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(memory, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping
    return pool.zero_()  # every page faulted in now, as torch.zeros does, not in the middle of a step


@dataclass
class LayerPools:
    """One layer's K and V block pools as the in-place attention kernels read them
    (:mod:`kvledger.kernels.paged_decode`): the stored elements, never a copy, and their scales.

    The real keys are ``k * k_scales * k_scale`` (per token and KV head, then per layer), and
    the real values likewise."""

    k: torch.Tensor  # [num_blocks, block_size, H_kv, d_h], the stored dtype (fp8 as its torch dtype)
    v: torch.Tensor
    k_scales: torch.Tensor | None = None  # [num_blocks, block_size, H_kv] float16 (int8 caches)
    v_scales: torch.Tensor | None = None
    k_scale: float = 1.0  # per layer (fp8 caches)
    v_scale: float = 1.0


class KVCache:
    """Per-layer K/V block pools and the two operations on them: write by slot, gather by block table."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 compute_dtype: torch.dtype | None = None) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.read_back_fresh = False
        """A prompt's first chunk attends over its own fresh K/V, unquantized, as vLLM's prefill
        kernels do; later tokens read the cache. ``True`` reads every key and value back from
        the cache, so each position sees exactly what a decode step would (kv-quality does)."""
        # Zeros, not empty: padded gathers read unused slots, and 0 * NaN would poison attention.
        self.storage = zeroed_pool((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device)
        self._flat = self.storage.view(num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)

    @property
    def quantized(self) -> bool:
        """True when the cache stores a narrower type than attention computes in (bf16 under an
        fp32 model, int8, fp8)."""
        return self.dtype != self.compute_dtype

    @property
    def measured_bytes(self) -> int:
        """Bytes of the real cache tensors (all layers, K and V)."""
        return self.storage.numel() * self.storage.element_size()

    def block_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold a block's bytes, each with the block as dimension 2: a block ``b``
        is ``[t[:, :, b] for t in block_tensors()]`` (the elements, and 8-bit caches' per-token
        scales). Copying these is copying the block exactly (the second KV tier does)."""
        return [self.storage]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[tokens, H_kv, d_h]``) at physical slots ``slot_mapping`` (``[tokens]``)."""
        self._flat[layer, 0].index_copy_(0, slot_mapping, k.to(self.dtype))
        self._flat[layer, 1].index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor, num_tokens: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for the sequences of ``block_tables`` (``[B, blocks]``) as ``[B, H_kv, T, d_h]``.

        ``T`` is ``blocks * block_size`` cut to ``num_tokens`` when given; positions past a
        sequence's length hold stale data and must be masked by the caller. Values come back
        in ``compute_dtype``.
        """
        k, v = self._gather_stored(layer, block_tables, num_tokens)
        if self.quantized:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v

    def layer_pools(self, layer: int) -> LayerPools:
        """Layer ``layer``'s pools ``[num_blocks, block_size, H_kv, d_h]`` as stored, for kernels
        that read K/V in place."""
        pools = self.storage[layer]
        return LayerPools(pools[0], pools[1])

    def gather_decode(self, layer: int, block_tables: torch.Tensor, num_tokens: int) -> DecodeKV:
        """K and V for decode steps, in the form attention reads fastest: for this cache, the
        dequantized :meth:`gather`; 8-bit caches widen their bytes and leave the scales apart."""
        k, v = self.gather(layer, block_tables, num_tokens)
        return DecodeKV(k, v)

    def _gather_stored(self, layer: int, block_tables: torch.Tensor, num_tokens: int | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as stored, ``[B, H_kv, T, d_h]``.

        Whole blocks are copied with ``index_select`` over the flattened table: it moves each
        block's bytes as one row, 1.2-4x faster than advanced indexing (``pool[block_tables]``,
        which copies element by element) at 1-64 sequences, and as fast for 8-bit as for wider
        types."""
        batch, blocks = block_tables.shape
        pool = self.storage[layer]
        flat_table = block_tables.reshape(-1)
        k = pool[0].index_select(0, flat_table)
        v = pool[1].index_select(0, flat_table)
        k = k.view(batch, blocks * self.block_size, self.num_kv_heads, self.head_dim)
        v = v.view(batch, blocks * self.block_size, self.num_kv_heads, self.head_dim)
        if num_tokens is not None:
            k, v = k[:, :num_tokens], v[:, :num_tokens]
        return k.transpose(1, 2), v.transpose(1, 2)
