"""Rotary position embeddings (RoPE), ``rotate_half`` layout, with the scaling variants.

``default`` is computed here; ``linear``, ``dynamic``, ``yarn``, ``llama3`` and the rest come
from transformers' reference implementations (one library per job), evaluated once at load.
``dynamic`` NTK scaling is evaluated at ``max_model_len`` tokens, as vLLM does, so one table
serves every position. cos/sin tables are precomputed in float32 for every position.
"""

from __future__ import annotations

from typing import Any

import torch

from kvledger.kernels import rotary as kernel


def _inv_freq(config: dict[str, Any], head_dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        base = float(scaling.get("rope_theta", config.get("rope_theta", 10000.0)))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        return 1.0 / (base ** exponent), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        from kvledger.errors import KVLedgerError

        raise KVLedgerError(f"RoPE scaling {rope_type!r} is not supported; supported: {sorted(ROPE_INIT_FUNCTIONS)}")
    keys = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype", "model_type")}
    hf_config = AutoConfig.for_model(config["model_type"], **keys)
    kwargs = {"seq_len": max_len} if rope_type == "dynamic" else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.to(torch.float32), float(scale)


class RotaryEmbedding:
    """Precomputed ``cos``/``sin`` ``[max_len, head_dim]`` and their application to q and k."""

    def __init__(self, config: dict[str, Any], head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        inv_freq, scale = _inv_freq(config, head_dim, max_len)
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[N, 1, d]`` for token ``positions`` ``[N]``; computed once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, d]`` (queries and keys may be stacked along heads) by ``cos`` and
    ``sin`` ``[N, 1, d]``. On CPU, eager, in float32 and bfloat16 this is one call of kvledger's
    ``rotary`` kernel (:mod:`kvledger.kernels.rotary`), with the same roundings as the six
    torch operators below, which run elsewhere (and which inductor fuses in a compiled graph):
    2 against 15 us for a decode token of SmolLM2's 12 heads, 82 against 221 us for 512 tokens."""
    if kernel.supports(x, cos, sin):
        return kernel.rotary(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
