"""The engine-setting flags several subcommands share (vLLM's names), one helper each.

Defaults and choices come from :mod:`kvledger.config`; a subcommand passes only what differs in
meaning (``plan`` leaves the scheduler's limits to the card, ``simulate`` takes a large card's),
and its own help text.
"""

from __future__ import annotations

import argparse

from kvledger.cli.common import fraction, positive_int, rate
from kvledger.config import (CUDA_BLOCK_SIZE, ENGINE_DTYPE, ENGINE_DTYPES, GPU_MEMORY_UTILIZATION,
                             KV_OFFLOADING_BACKEND, KV_OFFLOADING_BACKENDS, MAX_KV_OFFLOADING_GIB,
                             MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, VLLM_BLOCK_SIZES)
from kvledger.spec.dtypes import KV_CACHE_DTYPES

ENGINE_MODEL_HELP = ("smollm2-135m (default) or another preset with weights installed (gemma-3-270m), by any of its "
                     "names or its Hugging Face id; a .gguf file; or a model directory (config.json and *.safetensors)")
"""``--model`` of the commands that run the engine: the names :mod:`kvledger.spec.names` resolves to weights."""


def add_block_size(parser, *, default: int | None = CUDA_BLOCK_SIZE, vllm_sizes: bool = False,
                   metavar: str | None = None, help: str | None = None) -> None:
    """``--block-size``, tokens per KV block: one of vLLM's sizes (``vllm_sizes``, as the engine and
    ``plan`` take it) or any positive number of tokens."""
    if vllm_sizes:
        parser.add_argument("--block-size", type=int, default=default, choices=VLLM_BLOCK_SIZES, metavar="N", help=help)
    else:
        parser.add_argument("--block-size", type=positive_int, default=default, metavar=metavar, help=help)


def add_max_num_seqs(parser, *, default: int | None = MAX_NUM_SEQS, metavar: str | None = None,
                     help: str | None = None) -> None:
    """``--max-num-seqs``: the most requests running at once."""
    parser.add_argument("--max-num-seqs", type=positive_int, default=default, metavar=metavar, help=help)


def add_max_num_batched_tokens(parser, *, default: int | None = MAX_NUM_BATCHED_TOKENS, metavar: str | None = None,
                               help: str | None = None) -> None:
    """``--max-num-batched-tokens``: the token budget of one step."""
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=default, metavar=metavar, help=help)


def add_gpu_memory_utilization(parser, *, default: float | None = GPU_MEMORY_UTILIZATION, metavar: str | None = None,
                               help: str | None = None) -> None:
    """``--gpu-memory-utilization``: the share of the card the engine may claim, in (0, 1]."""
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=default, metavar=metavar, help=help)


def add_tensor_parallel_size(parser, *, metavar: str | None = "N", help: str | None = None) -> None:
    """``--tensor-parallel-size`` / ``-tp``: ranks the model is split over (default 1)."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar=metavar, help=help)


def add_engine_dtype(parser, *, help: str) -> None:
    """``--dtype`` of the engine's weights and activations; ``help`` is completed with the default."""
    parser.add_argument("--dtype", default=ENGINE_DTYPE, choices=ENGINE_DTYPES, help=f"{help} (default {ENGINE_DTYPE})")


def add_kv_cache_dtype(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """``--kv-cache-dtype`` of the planner's commands: every cache the planner counts."""
    parser.add_argument("--kv-cache-dtype", default=default, choices=KV_CACHE_DTYPES, metavar="D",
                        help=f"KV-cache element type: {', '.join(KV_CACHE_DTYPES)} (default: {default}, the model's dtype)")


def add_mamba_ssm_cache_dtype(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--mamba-ssm-cache-dtype`` for a hybrid model's SSM / delta-rule state."""
    from kvledger.spec.state import MAMBA_SSM_CACHE_DTYPES

    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES, metavar="D",
                        help="hybrid models: dtype of the SSM state, " + ", ".join(MAMBA_SSM_CACHE_DTYPES)
                             + " (default auto: the config's mamba_ssm_cache_dtype or mamba_ssm_dtype, the family's "
                               "default, else the model dtype); the conv state keeps the model dtype")


def _gib(text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not (0 <= value <= MAX_KV_OFFLOADING_GIB) or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"must be {'zero or ' if allow_zero else ''}a positive number of GiB of at "
                                         f"most 2^40, got {text}")
    return value


def kv_offloading_size(text: str) -> float:
    """One ``--kv-offloading-size``: a positive number of GiB (2^30 bytes), as vLLM takes it."""
    return _gib(text, allow_zero=False)


def kv_offloading_sizes(text: str) -> tuple[float, ...]:
    """A sweep of ``--kv-offloading-size``: GiB values separated by commas, 0 for no tier."""
    return tuple(_gib(part.strip(), allow_zero=True) for part in text.split(","))


def add_kv_offloading_size(parser, *, sweep: bool = False, default=None, help: str | None = None) -> None:
    """vLLM's ``--kv-offloading-size`` in GiB of a second KV tier; ``sweep``: a comma-separated list."""
    parser.add_argument("--kv-offloading-size", type=kv_offloading_sizes if sweep else kv_offloading_size,
                        default=default, metavar="GIB[,GIB...]" if sweep else "GIB",
                        help=help or "GiB (2^30 bytes) of a second KV tier in host memory, all ranks together "
                                     "(vLLM's flag)")


def add_kv_offloading_path(parser, *, help: str | None = None) -> None:
    """``--kv-offloading-path DIR``: the second KV tier on disk, in this directory."""
    parser.add_argument("--kv-offloading-path", metavar="DIR", default=None,
                        help=help or "keep the second KV tier in files under DIR (disk) instead of host memory")


def add_kv_offloading_backend(parser, *, default: str = KV_OFFLOADING_BACKEND) -> None:
    """vLLM's ``--kv-offloading-backend``: ``native`` runs; ``lmcache`` is refused by the config in one line."""
    parser.add_argument("--kv-offloading-backend", choices=KV_OFFLOADING_BACKENDS, default=default,
                        help=f"the second KV tier's implementation, vLLM's flag (default {default}: the engine's own; "
                             "lmcache is not run)")


def add_kv_offloading_bandwidth(parser, *, help: str | None = None) -> None:
    """``--kv-offloading-bandwidth RATE``: one direction of the link the tier's copies cross."""
    parser.add_argument("--kv-offloading-bandwidth", type=rate, default=None, metavar="RATE",
                        help=help or "bytes/s one way of the link between the KV tiers, e.g. 25GB/s (default: the "
                                     "card's host link in the GPU catalog, PCIe Gen4 or Gen5 x16)")
