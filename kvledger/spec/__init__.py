"""Model specs from real ``config.json`` files and Equation 2.2. Pure Python: never imports torch."""

from kvledger.spec.dtypes import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from kvledger.spec.kv_bytes import KVBytes, kv_bytes
from kvledger.spec.model_spec import ModelSpec
from kvledger.spec.names import load_model_spec
from kvledger.spec.presets import presets
from kvledger.spec.weights import count_params, weights_bytes

__all__ = [
    "KV_CACHE_DTYPES", "KVBytes", "ModelSpec", "count_params", "kv_bytes",
    "load_model_spec", "presets", "resolve_kv_cache_dtype", "weights_bytes",
]
