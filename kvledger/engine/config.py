"""Engine configuration with vLLM's flag names and meanings.

Sizes: ``kv_cache_memory`` is bytes for the KV block pool (an int, or a string such as
``"2GiB"``). When it is not given, CUDA takes 90% of the free device memory after the weights
(vLLM's ``--gpu-memory-utilization`` default) and the CPU takes ``CPU_KV_CACHE_SHARE`` (10%)
of the RAM available at start-up, at most ``CPU_KV_CACHE_MAX`` (4 GiB, vLLM's CPU default).
Token counts (``max_model_len``, ``max_num_batched_tokens``, ``block_size``) are in tokens.
``block_size`` left at None takes vLLM's default for the device (:func:`default_block_size`: 128
tokens on CPU, 16 on CUDA).
``seed`` seeds the draws of sampled requests that carry no seed of their own (None: torch's
global generator decides).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import re

from kvledger.errors import KVLedgerError
from kvledger.spec.dtypes import ENGINE_KV_CACHE_DTYPES

CUDA_BLOCK_SIZE = 16
"""Tokens per KV block on CUDA when none is given (vLLM's default there)."""
CPU_BLOCK_SIZE = 128
"""Tokens per KV block on CPU when none is given: vLLM's CPU platform sets 128 where the user set
none. Decode attention reads each sequence's blocks where they lie in the pool, and on CPU a
16-token block (12 KiB of K per layer for SmolLM2 in float32) is too short a run for the memory
system: 22 sequences of 340 tokens, 30 layers, 2 threads, AMD EPYC, 22.5 ms of attention a decode
step in blocks of 16 against 15.7 in blocks of 128 (BENCHMARKS.md)."""

VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
"""The ``--block-size`` values vLLM accepts on CUDA: the CLI's choices (the Python API takes any
positive size, as the scheduler's tests do)."""

CPU_KV_CACHE_SHARE = 0.10
CPU_KV_CACHE_MAX = 4 * 1024**3
GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class EngineConfig:
    """Everything that shapes an engine; field names are vLLM's engine arguments."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    block_size: int | None = None
    """Tokens per KV block; None: vLLM's default for the device (:func:`default_block_size`)."""
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float | None = None
    """vLLM's: the share of the device's memory (of the host's RAM on CPU) the engine may use; the
    KV pool gets that share less what is already in use. None: the defaults above."""
    seed: int | None = 0
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    """Ranks the model is split over (processes, one torch.distributed group; see
    :mod:`kvledger.distributed`). Each rank holds ``max(1, H_kv / N)`` KV heads and its own cache."""
    enforce_eager: bool = False
    """vLLM's switch that keeps the model step out of ``torch.compile``: True always runs it eagerly.
    False compiles it only where the environment asks for it with ``KVLEDGER_COMPILE=1``
    (:mod:`kvledger.engine.compile`; not the default until a benchmark shows it pays)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is None and name == "block_size":
                continue
            if not isinstance(value, int) or value < 1:
                raise KVLedgerError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise KVLedgerError(f"--max-model-len must be a positive integer, got {self.max_model_len!r}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise KVLedgerError(f"--dtype {self.dtype!r} is not supported; use float32, bfloat16 or float16")
        if self.kv_cache_memory is not None:
            from kvledger.units import parse_size

            self.kv_cache_memory = parse_size(self.kv_cache_memory, "--kv-cache-memory")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise KVLedgerError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise KVLedgerError(f"--device {self.device!r} is not supported; use cpu, cuda, cuda:N or auto")
        if self.kv_cache_dtype not in ENGINE_KV_CACHE_DTYPES:
            raise KVLedgerError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one the engine runs; choose one of "
                                f"{', '.join(ENGINE_KV_CACHE_DTYPES)}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise KVLedgerError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def default_block_size(device: str) -> int:
    """vLLM's tokens per KV block where none is given, for a ``--device`` value (``cpu``, ``cuda``,
    ``cuda:N``; ``auto`` is CUDA where torch sees a device)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CUDA_BLOCK_SIZE if device.startswith("cuda") else CPU_BLOCK_SIZE


def add_engine_args(parser: Any) -> None:
    """Add the engine flags (vLLM names) to an argparse parser; the server reuses this too."""
    import argparse

    from kvledger.cli.common import fraction, positive_int, size

    g = parser.add_argument_group("engine (vLLM flag names)")
    g.add_argument("--model", default=None,
                   help="smollm2-135m (default), gemma-3-270m, a .gguf file or an HF model directory")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations dtype (default float32)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if present)")
    g.add_argument("--block-size", type=int, default=None, choices=VLLM_BLOCK_SIZES, metavar="N",
                   help=f"tokens per KV block: {', '.join(map(str, VLLM_BLOCK_SIZES))} (default, as vLLM: "
                        f"{CPU_BLOCK_SIZE} on CPU, {CUDA_BLOCK_SIZE} on CUDA)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="max prompt + output tokens per request (default: the model's, capped by the pool)")
    g.add_argument("--max-num-seqs", type=positive_int, default=256, help="max running requests (default 256)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="token budget per step; longer prompts are prefilled in chunks (default 2048)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share cached full blocks of identical prefixes (default on)")
    g.add_argument("--kv-cache-memory", type=size, default=None, metavar="BYTES",
                   help="bytes for the KV block pool, e.g. 512MiB (default: CPU 10%% of available RAM, at most "
                        "4 GiB; CUDA 90%% of free memory)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=ENGINE_KV_CACHE_DTYPES, metavar="D",
                   help=f"KV cache element type: {', '.join(ENGINE_KV_CACHE_DTYPES)} (default auto = --dtype)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=None, metavar="F",
                   help="share of the device's memory (of RAM on CPU) the engine may use; the KV pool gets it less "
                        "what is in use (default: the --kv-cache-memory defaults)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never compile the model step with torch.compile; run it eagerly (vLLM's flag)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N",
                   help="split the model over N ranks (processes; gloo on CPU, NCCL on CUDA), each with 1/N of the "
                        "heads and its own KV cache (default 1)")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None, metavar="N",
                   help="exact number of KV blocks (overrides --kv-cache-memory)")


#: EngineConfig fields without an engine flag (``generate --seed`` is the sampling seed, not ``seed``).
_NO_FLAG = ("seed", "tokenizer")


def engine_config_from_args(args: Any) -> EngineConfig:
    """The :class:`EngineConfig` of the flags :func:`add_engine_args` added (same names)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in _NO_FLAG})
