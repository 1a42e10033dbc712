"""KV-cache element types, their size ``s`` in bytes (the last term of Eq 2.2) and their scales.

Names are vLLM's ``--kv-cache-dtype`` choices where vLLM has the layout:

* ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``: one byte per element and one float32 ``k_scale`` and
  ``v_scale`` per layer (a fixed cost, not per token);
* ``int8_per_token_head`` / ``fp8_per_token_head``: one byte per element plus one float32 scale
  per token, per KV head, for K and for V, carved from the same pool (vLLM's
  ``AttentionSpec.page_size_bytes`` adds ``2 x block_size x H_kv x 4`` per layer per block);
* ``int4_per_token_head``: two 4-bit elements packed per byte (``head_size // 2`` bytes per
  head for K and for V) plus one float32 scale per token, per KV head, for K and for V; the
  4-bit zero point rides in the scale's low mantissa bits, so it costs nothing more (vLLM's
  ``TritonAttentionBackend.customize_spec``: ``(d/2 + d/2) + 2 x 4`` bytes per token per head).
  The elements are rotated (a randomized Hadamard transform) before packing; that changes the
  values, not the bytes;
* ``int8``: kvledger's own engine cache, one byte per element plus one **float16** scale per
  token, per KV head, for K and V. It is not vLLM's ``int8_per_token_head``: same granularity,
  half the scale bytes (vLLM keeps float32 scales).
"""

from __future__ import annotations

from kvledger.errors import KVLedgerError

# Element size in bytes of each ``--kv-cache-dtype`` (0.5 for a packed 4-bit cache). ``auto`` is the model's dtype.
KV_CACHE_DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int8_per_token_head": 1,
    "fp8_per_token_head": 1,
    "int4_per_token_head": 0.5,
}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *KV_CACHE_DTYPE_BYTES)
"""Every cache the planner and ``kv-bytes`` count."""
ENGINE_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
"""The caches kvledger's engine implements."""
PER_TOKEN_SCALE_BYTES: dict[str, int] = {"int8": 2, "int8_per_token_head": 4, "fp8_per_token_head": 4,
                                         "int4_per_token_head": 4}
"""Bytes of the scale each token keeps per KV head, for K and for V."""
PER_LAYER_SCALE_DTYPES: tuple[str, ...] = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""Caches with one float32 K scale and one V scale per layer (and none per token)."""
STORAGE_DTYPES: dict[str, str] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                                  "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                                  "int8": "int8", "float64": "float64"}
"""The element each engine cache stores, by the name of its torch dtype (torch-free here; the
one torch mapping that reads it is :func:`kvledger.kvcache.storage.torch_dtype`). fp8 formats
are their float8 dtypes; int8 is int8 (its float16 scales apart)."""
# float64 is no serving dtype, but the verify artifact runs in it.
KV_CACHE_DTYPE_BYTES["float64"] = 8
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
# Quantized kinds store scales beside the elements; see scale_bytes_per_token in kv_bytes.
QUANTIZED_KV_DTYPES: tuple[str, ...] = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head",
                                        "int4_per_token_head")
ENGINE_QUANTIZED_KV_DTYPES: tuple[str, ...] = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
"""The quantized caches the engine (and ``kv-quality``) runs."""
KV_QUALITY_DEFAULT_KINDS: tuple[str, ...] = ("int8", "fp8_e4m3", "fp8_e5m2")
"""The 8-bit kinds ``kvledger kv-quality`` compares with the unquantized cache by default."""


def is_fp8(kv_cache_dtype: str) -> bool:
    """Whether the cache stores fp8 elements (per-layer or per-token-head scales)."""
    return kv_cache_dtype.startswith("fp8")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The concrete dtype name: ``auto`` becomes the model's dtype."""
    name = DTYPE_ALIASES.get(kv_cache_dtype.lower(), kv_cache_dtype.lower())
    if name == "auto":
        name = DTYPE_ALIASES.get(model_dtype.lower(), model_dtype.lower())
        if name not in KV_CACHE_DTYPE_BYTES:
            raise KVLedgerError(f"the model's dtype {model_dtype!r} is not a KV-cache dtype; pass --kv-cache-dtype")
    if name not in KV_CACHE_DTYPE_BYTES:
        raise KVLedgerError(f"unknown KV-cache dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return name
