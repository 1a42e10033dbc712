"""The chapter's "Do it" artifact: causal attention computed twice, and the cache weighed.

A stack of ``L`` attention layers (Q/K/V/O projections, RoPE, residual; each layer's output
feeds the next) runs over ``B`` sequences of ``T`` tokens:

1. **full**: every position at once, with a triangular (causal) mask;
2. **cached**: one token at a time, each layer appending that token's K and V to an
   append-only cache and attending over everything appended so far.

The two outputs must agree to within a tolerance, and the bytes of the cache tensors
actually allocated must equal Eq 2.2's prediction to the byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvledger.errors import KVLedgerError
from kvledger.progress import ProgressBar, progress_bar
from kvledger.spec import ModelSpec, kv_bytes

DTYPES = {"float32": torch.float32, "float64": torch.float64}
DEFAULT_TOLERANCE = {"float32": 1e-5, "float64": 1e-12}


@dataclass(frozen=True)
class VerifyConfig:
    layers: int = 1
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 128
    tokens: int = 64
    batch: int = 1
    dtype: str = "float32"
    rope: bool = True
    rope_theta: float = 10000.0
    seed: int = 0
    tolerance: float | None = None

    def check(self) -> None:
        for name in ("layers", "heads", "kv_heads", "head_dim", "tokens", "batch"):
            if getattr(self, name) <= 0:
                raise KVLedgerError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise KVLedgerError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads} (each KV head serves a group of query heads)")
        if self.rope and self.head_dim % 2:
            raise KVLedgerError(f"RoPE rotates pairs of elements: --head-dim must be even, got {self.head_dim} (or pass --no-rope)")
        if self.dtype not in DTYPES:
            raise KVLedgerError(f"--dtype must be float32 or float64, got {self.dtype!r}")

    def spec(self) -> ModelSpec:
        """The artifact's geometry as a model spec (for Eq 2.2 and the attention kind)."""
        return ModelSpec.custom(self.layers, self.kv_heads, self.head_dim, heads=self.heads,
                                torch_dtype=self.dtype, name="verify")


@dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float
    tolerance: float
    predicted_bytes: int
    measured_bytes: int
    passed: bool
    config: VerifyConfig


class AttentionLayer(torch.nn.Module):
    """One causal self-attention layer with grouped KV heads and a residual connection."""

    def __init__(self, cfg: VerifyConfig):
        super().__init__()
        hidden = cfg.heads * cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q = torch.nn.Linear(hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k = torch.nn.Linear(hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = torch.nn.Linear(hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = torch.nn.Linear(cfg.heads * cfg.head_dim, hidden, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, H, T, d], k and v [B, H_kv, T, d]."""
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Softmax(q k^T / sqrt(d)) v over all keys given, then O and the residual."""
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        b, _, t, _ = out.shape
        return x + self.o(out.transpose(1, 2).reshape(b, t, -1))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [B, heads, T, d] at ``positions`` [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    angles = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class AppendOnlyKVCache:
    """Per layer, K and V tensors [B, H_kv, T_max, d]; tokens are appended and never revised."""

    def __init__(self, cfg: VerifyConfig, dtype: torch.dtype):
        shape = (cfg.batch, cfg.kv_heads, cfg.tokens, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.layers)]
        self.length = [0] * cfg.layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one token's k, v [B, H_kv, 1, d]; return all cached K, V so far."""
        t = self.length[layer]
        self.keys[layer][:, :, t: t + 1] = k
        self.values[layer][:, :, t: t + 1] = v
        self.length[layer] = t + 1
        return self.keys[layer][:, :, : t + 1], self.values[layer][:, :, : t + 1]

    def nbytes(self) -> int:
        """Bytes of the storage actually allocated for the cache."""
        return sum(t.untyped_storage().nbytes() for t in self.keys + self.values)


def _full(layers: list[AttentionLayer], x: torch.Tensor, cfg: VerifyConfig) -> torch.Tensor:
    positions = torch.arange(cfg.tokens)
    mask = torch.ones(cfg.tokens, cfg.tokens, dtype=torch.bool).tril()
    for layer in layers:
        q, k, v = layer.project(x)
        if cfg.rope:
            q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        x = layer.attend(x, q, k, v, mask)
    return x


def _cached(layers: list[AttentionLayer], x: torch.Tensor, cfg: VerifyConfig, cache: AppendOnlyKVCache,
            bar: ProgressBar) -> torch.Tensor:
    outputs = []
    for t in range(cfg.tokens):
        h = x[:, t: t + 1]
        position = torch.tensor([t])
        for i, layer in enumerate(layers):
            q, k, v = layer.project(h)
            if cfg.rope:
                q, k = rope(q, position, cfg.rope_theta), rope(k, position, cfg.rope_theta)
            keys, values = cache.append(i, k, v)
            h = layer.attend(h, q, keys, values, mask=None)  # one query sees every cached token
        outputs.append(h)
        bar.update(1)
    return torch.cat(outputs, dim=1)


def predicted_cache_bytes(cfg: VerifyConfig) -> int:
    """Eq 2.2 for the artifact's own geometry."""
    return kv_bytes(cfg.spec(), "auto", tokens=cfg.tokens, batch=cfg.batch).total_bytes


def run_verify(cfg: VerifyConfig, progress: bool = False) -> VerifyResult:
    """Run both passes and weigh the cache. ``progress``: a bar on stderr over the cached pass's
    tokens (the long part: each token attends over all the cache holds), shown once it runs a while."""
    cfg.check()
    dtype = DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)
    with torch.inference_mode():
        layers = [AttentionLayer(cfg).to(dtype) for _ in range(cfg.layers)]
        x = torch.randn(cfg.batch, cfg.tokens, cfg.heads * cfg.head_dim, dtype=dtype)
        full = _full(layers, x, cfg)
        cache = AppendOnlyKVCache(cfg, dtype)
        bar = progress_bar(cfg.tokens, "verify", "token", enabled=progress)
        try:
            cached = _cached(layers, x, cfg, cache, bar)
        finally:
            bar.close()
        diff = (full - cached).abs().max().item()
    tolerance = cfg.tolerance if cfg.tolerance is not None else DEFAULT_TOLERANCE[cfg.dtype]
    predicted, measured = predicted_cache_bytes(cfg), cache.nbytes()
    return VerifyResult(max_abs_diff=diff, tolerance=tolerance, predicted_bytes=predicted, measured_bytes=measured,
                        passed=diff <= tolerance and predicted == measured, config=cfg)
