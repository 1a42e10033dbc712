"""What the model's config and the flags allow, known before the model loads: how long a request
may be (in tokens) and how large a KV pool the device holds (in bytes). Imports no torch.

``generate``, ``serve``, ``calibrate`` (before torch is imported) and :class:`~kvledger.LLM` call
:func:`check_before_loading`, so that a name without weights, a ``--max-tokens`` or
``--max-model-len`` beyond the model's context, or a pool beyond the host's memory, is refused in
a second; the model runner makes the same checks (:func:`context_limit`,
:func:`check_pool_memory`) before it reads a weight, the pool's on any device. Once the pool is
sized, the engine admits each request with :func:`check_request_length`
against its ``max_model_len`` (which the pool may have lowered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pathlib import Path

from kvledger.config import EngineConfig, default_block_size
from kvledger.errors import KVLedgerError
from kvledger.spec import ModelSpec, kv_bytes, resolve_kv_cache_dtype
from kvledger.spec.kv_bytes import KVBytes
from kvledger.units import available_ram_bytes, format_bytes

DEFAULT_MAX_POSITIONS = 2048
"""A model's context, in tokens, where its config names no ``max_position_embeddings``."""


@dataclass(frozen=True)
class ContextLimit:
    """The longest request (prompt + output, in tokens) a model admits before its pool is sized:
    ``tokens``, and where the number came from (``source``, for messages)."""

    tokens: int
    source: str


def context_limit(config: EngineConfig, hf_config: dict[str, Any], model_name: str) -> ContextLimit:
    """``--max-model-len`` where given (refused beyond the model's ``max_position_embeddings``),
    else the model's context; a sized pool may lower it further."""
    max_pos = int(hf_config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)
    if config.max_model_len is None:
        return ContextLimit(max_pos, f"{model_name}'s max_position_embeddings")
    if config.max_model_len > max_pos:
        raise KVLedgerError(f"--max-model-len {config.max_model_len:,} exceeds {model_name}'s context "
                            f"(max_position_embeddings = {max_pos:,}); give {max_pos:,} or less")
    return ContextLimit(config.max_model_len, "--max-model-len")


def check_request_length(prompt_tokens: int, max_tokens: int, max_model_len: int, *, prompt_exact: bool = True,
                         flag: str = "max_tokens", source: str = "") -> None:
    """Refuse a request whose prompt (``prompt_tokens``; at least that many where not
    ``prompt_exact``, before the prompt is tokenized) and ``max_tokens`` generated tokens do not fit
    ``max_model_len`` tokens, or that leaves no token to generate. ``flag`` names max_tokens as the
    user gave it; ``source`` says where the limit came from."""
    total = prompt_tokens + max_tokens
    if max_tokens >= 1 and total <= max_model_len:
        return
    prompt = f"prompt {prompt_tokens:,} tokens" if prompt_exact else f"a prompt of at least {prompt_tokens:,} token"
    room = max_model_len - prompt_tokens
    if room < 1:
        fix = "shorten the prompt" if prompt_exact else "raise --max-model-len"
    else:
        fix = f"{'shorten the prompt or ' if prompt_exact else ''}lower {flag} to {room:,} or less"
    where = f" ({source})" if source else ""
    raise KVLedgerError(f"{prompt} + {flag} {max_tokens:,} = {total:,} exceeds --max-model-len "
                        f"{max_model_len:,}{where}; {fix}")


def kv_layout(config: EngineConfig, hf_config: dict[str, Any], model_name: str
              ) -> tuple[ModelSpec, str, list[KVBytes]]:
    """(the model's spec in the engine's dtype, the cache's dtype, Eq 2.2 for one token on each
    tensor-parallel rank): the arithmetic of the pool, from the config alone. Rank 0's is the
    largest (an uneven head split gives the first ranks one KV head more), and every rank's pool
    is sized by it. Raises for a tensor-parallel size the model's heads cannot be split over."""
    dtype_name = "float32" if config.dtype == "auto" else config.dtype
    kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype_name)
    spec = ModelSpec.from_config_dict({**hf_config, "torch_dtype": dtype_name}, name=model_name)
    tp = config.tensor_parallel_size
    by_rank = [kv_bytes(spec, kv_cache_dtype, tensor_parallel_size=tp, rank=r) for r in range(tp)]
    return spec, kv_cache_dtype, by_rank


def check_pool_memory(config: EngineConfig, kv_by_rank: list[KVBytes], num_blocks: int, block_size: int,
                      device_type: str, free_bytes: int) -> None:
    """Refuse a pool of ``num_blocks`` blocks of ``block_size`` tokens that needs more than the
    ``free_bytes`` the device has: every rank's pool on a CPU, where the ranks share the host's
    RAM, rank 0's (the largest) on a GPU of its own."""
    ranks = kv_by_rank if device_type == "cpu" else kv_by_rank[:1]
    pool_bytes = sum(kv.pages_bytes(num_blocks, block_size) for kv in ranks)
    if pool_bytes > free_bytes:
        flag = "--num-gpu-blocks-override" if config.num_gpu_blocks_override else "--kv-cache-memory"
        raise KVLedgerError(f"the KV pool of {num_blocks:,} blocks needs {format_bytes(pool_bytes)} but the "
                            f"{device_type} has {format_bytes(free_bytes)} free; lower {flag}")


def cuda_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded (``/proc/driver/nvidia/gpus`` lists a GPU): without one,
    ``--device auto`` is the CPU, known without importing torch."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def check_before_loading(config: EngineConfig, max_tokens: int | None = None, flag: str = "--max-tokens") -> None:
    """What the model's config tells before torch or the model loads: the model's name resolves to
    weights; ``--max-model-len`` is within the model's context and, where given, ``max_tokens``
    (plus a prompt of at least one token) within that; a pool the user sized
    (``--num-gpu-blocks-override``, ``--kv-cache-memory``) fits the host's available memory, where
    the device is the CPU."""
    from kvledger.loader.resolve import model_config, resolve_model

    checkpoint = resolve_model(config.model)
    hf_config = model_config(checkpoint)
    limit = context_limit(config, hf_config, checkpoint.name)
    if max_tokens is not None:
        check_request_length(1, max_tokens, limit.tokens, prompt_exact=False, flag=flag, source=limit.source)
    on_cpu = config.device == "cpu" or (config.device == "auto" and not cuda_driver_present())
    if on_cpu and (config.num_gpu_blocks_override is not None or config.kv_cache_memory is not None):
        _, _, kv_by_rank = kv_layout(config, hf_config, checkpoint.name)
        block_size = config.block_size or default_block_size("cpu")
        num_blocks = (config.num_gpu_blocks_override
                      or kv_by_rank[0].num_pages(int(config.kv_cache_memory), block_size))
        check_pool_memory(config, kv_by_rank, num_blocks, block_size, "cpu", available_ram_bytes())
