"""KV-cache element types and their size ``s`` in bytes (the last term of Eq 2.2)."""

from __future__ import annotations

from kvledger.errors import KVLedgerError

# Element size in bytes of each ``--kv-cache-dtype`` (vLLM's names). ``auto`` is the model's dtype.
KV_CACHE_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *KV_CACHE_DTYPE_BYTES)
# float64 is no serving dtype, but the verify artifact runs in it.
KV_CACHE_DTYPE_BYTES["float64"] = 8
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
# 8-bit kinds store a scale beside the elements; see scale_bytes_per_token in kv_bytes.
QUANTIZED_KV_DTYPES: tuple[str, ...] = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_QUALITY_DEFAULT_KINDS: tuple[str, ...] = ("int8", "fp8_e4m3", "fp8_e5m2")
"""The 8-bit kinds ``kvledger kv-quality`` compares with the unquantized cache by default."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The concrete dtype name: ``auto`` becomes the model's dtype."""
    name = _ALIASES.get(kv_cache_dtype.lower(), kv_cache_dtype.lower())
    if name == "auto":
        name = _ALIASES.get(model_dtype.lower(), model_dtype.lower())
        if name not in KV_CACHE_DTYPE_BYTES:
            raise KVLedgerError(f"the model's dtype {model_dtype!r} is not a KV-cache dtype; pass --kv-cache-dtype")
    if name not in KV_CACHE_DTYPE_BYTES:
        raise KVLedgerError(f"unknown KV-cache dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return name

