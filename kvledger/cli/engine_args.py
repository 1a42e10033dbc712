"""The engine's flags (vLLM's names), declared from :class:`kvledger.config.EngineConfig`: ``generate``
and ``serve`` add them, and the config is built back from the parsed flags."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from kvledger.cli.common import positive_int, size
from kvledger.cli.flags import (ENGINE_MODEL_HELP, add_block_size, add_engine_dtype, add_gpu_memory_utilization,
                                add_kv_offloading_backend, add_kv_offloading_path, add_kv_offloading_size,
                                add_max_num_batched_tokens, add_max_num_seqs, add_tensor_parallel_size)
from kvledger.config import (CPU_BLOCK_SIZE, CPU_KV_CACHE_MAX, CPU_KV_CACHE_SHARE, CUDA_BLOCK_SIZE, GPU_MEMORY_UTILIZATION,
                             VLLM_BLOCK_SIZES, EngineConfig)
from kvledger.spec.dtypes import ENGINE_KV_CACHE_DTYPES
from kvledger.units import GiB

#: EngineConfig fields without an engine flag (``generate --seed`` is the sampling seed, not ``seed``).
_NO_FLAG = ("seed", "tokenizer")


def add_engine_args(parser: Any) -> None:
    """Add the engine flags (vLLM names) to an argparse parser; the server reuses this too."""
    default = EngineConfig()
    g = parser.add_argument_group("engine (vLLM flag names)")
    g.add_argument("--model", default=default.model,
                   help=ENGINE_MODEL_HELP)
    add_engine_dtype(g, help="weights and activations dtype")
    g.add_argument("--device", default=default.device, help="cpu, cuda, cuda:N or auto (default: cuda if present)")
    add_block_size(g, default=default.block_size, vllm_sizes=True,
                   help=f"tokens per KV block: {', '.join(map(str, VLLM_BLOCK_SIZES))} (default, as vLLM: "
                        f"{CPU_BLOCK_SIZE} on CPU, {CUDA_BLOCK_SIZE} on CUDA)")
    g.add_argument("--max-model-len", type=positive_int, default=default.max_model_len,
                   help="max prompt + output tokens per request (default: the model's, capped by the pool)")
    add_max_num_seqs(g, default=default.max_num_seqs, help=f"max running requests (default {default.max_num_seqs})")
    add_max_num_batched_tokens(g, default=default.max_num_batched_tokens,
                               help="token budget per step; longer prompts are prefilled in chunks "
                                    f"(default {default.max_num_batched_tokens})")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=default.enable_prefix_caching,
                   help="share cached full blocks of identical prefixes (default on)")
    g.add_argument("--kv-cache-memory", type=size, default=default.kv_cache_memory, metavar="BYTES",
                   help=f"bytes for the KV block pool, e.g. 512MiB (default: CPU {round(CPU_KV_CACHE_SHARE * 100)}%% "
                        f"of available RAM, at most {CPU_KV_CACHE_MAX // GiB} GiB; CUDA "
                        f"{round(GPU_MEMORY_UTILIZATION * 100)}%% of free memory)")
    g.add_argument("--kv-cache-dtype", default=default.kv_cache_dtype, choices=ENGINE_KV_CACHE_DTYPES, metavar="D",
                   help=f"KV cache element type: {', '.join(ENGINE_KV_CACHE_DTYPES)} (default auto = --dtype)")
    add_gpu_memory_utilization(g, default=default.gpu_memory_utilization, metavar="F",
                               help="share of the device's memory (of RAM on CPU) the engine may use; the KV pool "
                                    "gets it less what is in use (default: the --kv-cache-memory defaults)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never compile the model step with torch.compile; run it eagerly (vLLM's flag)")
    add_tensor_parallel_size(g, help="split the model over N ranks (processes; gloo on CPU, NCCL on CUDA), each with "
                                     f"1/N of the heads and its own KV cache (default {default.tensor_parallel_size})")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=default.num_gpu_blocks_override,
                   metavar="N", help="exact number of KV blocks (overrides --kv-cache-memory)")
    t = parser.add_argument_group("second KV tier (vLLM's KV offloading)")
    add_kv_offloading_size(t, default=default.kv_offloading_size,
                           help="GiB (2^30 bytes) of a second KV tier under the pool (vLLM's flag): blocks the pool "
                                "evicts are kept there and loaded back on a prefix hit (default: no tier)")
    add_kv_offloading_backend(t, default=default.kv_offloading_backend)
    add_kv_offloading_path(t, help="keep the tier's blocks in files under DIR instead of host memory; a restarted "
                                   "engine on the same DIR finds them again (default: host memory)")


def engine_config_from_args(args: Any) -> EngineConfig:
    """The :class:`EngineConfig` of the flags :func:`add_engine_args` added (same names)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in _NO_FLAG})
