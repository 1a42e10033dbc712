"""The step-time model: one engine step's seconds as a sum of coefficient x term.

For a scheduled batch (each request: ``c`` tokens already cached, ``n`` new ones this step) the
terms are, per rank:

========================  ===========================================================  ==========
term                      value for the batch                                          coefficient
========================  ===========================================================  ==========
``step``                  1 (launches, per-layer constants, sampling set-up)            s
``weight_bytes``          weight bytes read (dense: all; MoE: the experts touched)     s/byte
``prefill_tokens``        sum of ``n`` over chunks (``n > 1``)                         s/token
``prefill_attention``     sum over chunks of ``n*c + n*(n+1)/2`` (query-key pairs)     s/pair
``decode_tokens``         number of decoding requests (``n == 1``)                     s/token
``kv_read_bytes``         sum of ``c`` x KV bytes per token                            s/byte
``kv_write_bytes``        sum of ``n`` x KV bytes per token                            s/byte
``allreduce_bytes``       TP all-reduce bytes (two per layer, ring, per rank)          s/byte
``requests``              scheduled requests                                           s/request
``cpu_step``              1: CPU overhead of a step (schedule, inputs, outputs)        s
``cpu_samples``           sampled tokens (sampling, detokenizing, streaming)           s/token
``arrivals``              requests the server received during the step                 s/request
========================  ===========================================================  ==========

``step = sum(coefficient[t] * term[t])``: a linear model, so it adds compute and memory time
where a roofline would take the larger of the two; that is the main thing it assumes, and
what calibration on a real device corrects (the fit chooses the coefficients). The CPU terms
are their own: on a GPU the CPU work between two model runs is not hidden behind them
(no asynchronous scheduling is modelled).

``arrivals`` is not known when a step starts: the simulator lengthens a running step by
its coefficient for every request that arrives during it (and a step that an arrival starts on
an idle engine, for each request that started it). It is what receiving a request (HTTP,
parsing, validating, the client's own sending on the same host) takes from a step when the
server's front end shares the engine's cores, as ``kvledger serve``'s does on a CPU: mostly a
slower model run (measured on 2 cores: 4.2 ms of model run and 0.4 ms of CPU overhead per
request received). A fit from a serving run's step log measures it, in both parts; the catalog's
coefficients leave it at 0 (on a GPU the model run does not share the front end's cores).

Default coefficients (``--gpu``) come from the GPU catalog's peaks and the efficiency factors
below; a profile written by ``kvledger calibrate`` replaces them with fitted ones.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvledger.errors import KVLedgerError, parse_json
from kvledger.spec import ModelSpec, count_params, kv_bytes, weights_bytes

TERMS = ("step", "weight_bytes", "prefill_tokens", "prefill_attention", "decode_tokens", "kv_read_bytes",
         "kv_write_bytes", "allreduce_bytes", "requests", "cpu_step", "cpu_samples", "arrivals")
"""The step model's terms, in the order of :func:`batch_terms`."""
GPU_TERMS = TERMS[:9]
"""Terms of the model run (what ``model_s`` of a step record measures)."""
CPU_TERMS = TERMS[9:]
"""Terms of the CPU work around it (``wall_s - model_s``); a serving run's fit also fits
``arrivals`` to the model run, and its coefficient is the sum of the two."""

PREFILL_FLOP_EFFICIENCY = 0.5
"""Share of the dense bf16 peak a prefill's matrix multiplies sustain (MFU), as the planner assumes."""
DECODE_FLOP_EFFICIENCY = 0.5
"""The same for a decode batch's matrix multiplies (their weight reads are a term of their own)."""
ATTENTION_FLOP_EFFICIENCY = 0.35
"""Share of the peak a prefill's attention sustains (FlashAttention-2 on H100 reaches 35-50%)."""
BANDWIDTH_EFFICIENCY = 0.75
"""Share of the datasheet HBM bandwidth a step's weight and KV reads sustain (the planner's default)."""
ALLREDUCE_BYTES_PER_S = 150e9
"""Sustained all-reduce bus bandwidth per rank over NVLink (NCCL ring, mid-size messages); the
catalog has no interconnect figures, so one documented value serves every card."""
STEP_OVERHEAD_PER_LAYER_S = 15e-6
"""Fixed GPU time per layer per step (kernel launches and small ops, CUDA graphs on)."""
REQUEST_OVERHEAD_S = 5e-6
"""GPU time per scheduled request (metadata, sampling)."""
CPU_STEP_S = 2e-3
"""CPU time per step outside the model run (scheduling, input preparation, output handling);
vLLM V1's own traces put it at 1-3 ms for an 8B model."""
CPU_SAMPLE_S = 20e-6
"""CPU time per sampled token (detokenizing and streaming it)."""


@dataclass(frozen=True)
class ModelFingerprint:
    """The numbers of a model that a step profile depends on; two models with the same fingerprint
    have the same step times on the same device."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int

    @classmethod
    def of(cls, spec: ModelSpec) -> "ModelFingerprint":
        return cls(spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
                   spec.num_kv_heads, spec.head_dim, spec.vocab_size, spec.num_experts)


@dataclass(frozen=True)
class ModelGeometry:
    """What the terms need from the model, per rank: bytes per cached token, weights, MoE shape."""

    token_bytes: int
    """KV bytes per token per rank (elements and scales)."""
    weight_bytes: int
    """Weight bytes per rank when every expert is read."""
    expert_bytes: int
    """Per rank, the bytes of one routed expert in all layers (0 for a dense model)."""
    num_experts: int
    experts_per_token: int
    allreduce_bytes_per_token: float
    """Per rank: two all-reduces per layer of ``hidden`` activations, ring (``2 (tp-1)/tp`` of them)."""
    active_flops_per_token: float
    """``2 x`` parameters one token passes through, per rank."""
    attention_flops_per_pair: float
    """FLOPs per query-key pair, per rank: QK^T and PV, ``4 x heads x head_dim`` per layer."""
    num_layers: int

    @classmethod
    def of(cls, spec: ModelSpec, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
           act_bytes: int = 2) -> "ModelGeometry":
        from kvledger.planner.bandwidth import active_params

        tp = tensor_parallel_size
        kvb = kv_bytes(spec, kv_cache_dtype, tensor_parallel_size=tp)
        all_weights = weights_bytes(spec)
        params = count_params(spec)
        expert_bytes = 0
        if spec.is_moe and params.total:
            expert_bytes = int(all_weights * params.expert / params.total / spec.num_experts / tp)
        ring = 2 * (tp - 1) / tp
        heads = spec.num_attention_heads // tp if spec.num_attention_heads >= tp else 1
        return cls(token_bytes=kvb.token_bytes, weight_bytes=math.ceil(all_weights / tp), expert_bytes=expert_bytes,
                   num_experts=spec.num_experts, experts_per_token=spec.num_experts_per_token,
                   allreduce_bytes_per_token=2 * spec.num_layers * spec.hidden_size * act_bytes * ring,
                   active_flops_per_token=2 * active_params(spec) / tp,
                   attention_flops_per_pair=4 * spec.num_layers * heads * spec.head_dim,
                   num_layers=spec.num_layers)

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weights a step over ``num_tokens`` tokens reads: all of a dense model; for MoE, the dense
        part plus the experts at least one token is routed to (uniform routing, in expectation)."""
        if not self.expert_bytes:
            return float(self.weight_bytes)
        e, k = self.num_experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** num_tokens)
        return self.weight_bytes - self.expert_bytes * (e - touched)


def batch_sums(batch: Iterable[tuple[int, int]]) -> tuple[int, int, int, int, int, int]:
    """(requests, new tokens, cached context tokens, decoding requests, prefill tokens, query-key
    pairs of the prefill chunks) of a batch of ``(num_computed_tokens, num_new_tokens)``."""
    prefill = attention = decode = context = tokens = requests = 0
    for c, n in batch:
        requests += 1
        tokens += n
        context += c
        if n == 1:
            decode += 1
        else:
            prefill += n
            attention += n * c + n * (n + 1) // 2
    return requests, tokens, context, decode, prefill, attention


def batch_terms(geometry: ModelGeometry, batch: Iterable[tuple[int, int]], num_samples: int,
                num_arrivals: int = 0) -> list[float]:
    """The terms (in :data:`TERMS` order) of a batch of ``(num_computed_tokens, num_new_tokens)``
    during which the server received ``num_arrivals`` requests."""
    requests, tokens, context, decode, prefill, attention = batch_sums(batch)
    tb = geometry.token_bytes
    return [1.0, geometry.weight_bytes_read(tokens), prefill, attention, decode, context * tb, tokens * tb,
            tokens * geometry.allreduce_bytes_per_token, requests, 1.0, num_samples, num_arrivals]


@dataclass
class StepModel:
    """Coefficients (seconds per unit of each term) for one model on one device."""

    geometry: ModelGeometry
    coefficients: dict[str, float]
    source: str
    """Where the coefficients come from: ``catalog:<gpu>`` or ``profile:<file>``."""

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(TERMS)
        if unknown:
            raise KVLedgerError(f"unknown step-model terms {sorted(unknown)}; known: {', '.join(TERMS)}")
        self._coef = [float(self.coefficients.get(t, 0.0)) for t in TERMS]
        k = dict(zip(TERMS, self._coef))
        g = self.geometry
        # the dot product of coefficients and terms, folded (the simulator prices every step)
        self._fixed = k["step"] + k["cpu_step"]
        self._per_token = (k["kv_write_bytes"] * g.token_bytes + k["allreduce_bytes"] * g.allreduce_bytes_per_token)
        self._dense_weights = None if g.expert_bytes else k["weight_bytes"] * g.weight_bytes
        self.arrival_seconds = k["arrivals"]
        """Seconds a step gains per request received during it (the ``arrivals`` term)."""

    def step_seconds(self, batch: Iterable[tuple[int, int]], num_samples: int) -> float:
        """Seconds of one step (model run plus CPU overhead) for the batch: ``sum(coefficient x term)``,
        arrivals during it apart (:attr:`arrival_seconds`)."""
        requests, tokens, context, decode, prefill, attention = batch_sums(batch)
        w, pf, att, dec, kvr = self._coef[1:6]
        weights = self._dense_weights
        if weights is None:
            weights = w * self.geometry.weight_bytes_read(tokens)
        return (self._fixed + weights + pf * prefill + att * attention + dec * decode
                + kvr * context * self.geometry.token_bytes + self._per_token * tokens
                + self._coef[8] * requests + self._coef[10] * num_samples)

    def prefill_seconds(self, tokens: int, chunk: int) -> float:
        """Seconds to prefill ``tokens`` tokens of one request alone, ``chunk`` tokens a step
        (chunked prefill); the last step samples."""
        seconds, done = 0.0, 0
        while done < tokens:
            n = min(chunk, tokens - done)
            seconds += self.step_seconds([(done, n)], 1 if done + n == tokens else 0)
            done += n
        return seconds

    @classmethod
    def from_gpu(cls, spec: ModelSpec, gpu: Any, kv_cache_dtype: str = "auto",
                 tensor_parallel_size: int = 1) -> "StepModel":
        """Default coefficients from the catalog entry ``gpu`` and the efficiency factors above."""
        geo = ModelGeometry.of(spec, kv_cache_dtype, tensor_parallel_size)
        flops, bw = gpu.bf16_flops, gpu.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY
        coefficients = {
            "step": STEP_OVERHEAD_PER_LAYER_S * spec.num_layers,
            "weight_bytes": 1 / bw,
            "prefill_tokens": geo.active_flops_per_token / (flops * PREFILL_FLOP_EFFICIENCY),
            "prefill_attention": geo.attention_flops_per_pair / (flops * ATTENTION_FLOP_EFFICIENCY),
            "decode_tokens": geo.active_flops_per_token / (flops * DECODE_FLOP_EFFICIENCY),
            "kv_read_bytes": 1 / bw,
            "kv_write_bytes": 1 / bw,
            "allreduce_bytes": 1 / ALLREDUCE_BYTES_PER_S if tensor_parallel_size > 1 else 0.0,
            "requests": REQUEST_OVERHEAD_S,
            "cpu_step": CPU_STEP_S,
            "cpu_samples": CPU_SAMPLE_S,
            "arrivals": 0.0,
        }
        return cls(geo, coefficients, f"catalog:{gpu.name}")


# ---------------------------------------------------------------------------------- profiles
PROFILE_KIND = "kvledger-step-profile"
PROFILE_VERSION = 1


@dataclass
class Profile:
    """Fitted coefficients and what they were measured on (``kvledger calibrate`` writes it).

    ``fit`` holds one row per measured shape: the batch, measured and predicted seconds, and the
    relative error. A profile is only valid for its model (``fingerprint``), dtype and TP size."""

    device: str
    model: str
    fingerprint: ModelFingerprint
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    num_blocks: int | None
    coefficients: dict[str, float]
    fit: list[dict[str, Any]] = field(default_factory=list)
    host: str = field(default_factory=platform.node)
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": PROFILE_KIND, "version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        try:
            p.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        except OSError as err:
            raise KVLedgerError(f"cannot write the profile {p}: {err.strerror or err}") from None
        return p

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        p = Path(path)
        try:
            data = parse_json(p.read_text())
        except FileNotFoundError:
            raise KVLedgerError(f"no such profile: {p}; write one with 'kvledger calibrate --out {p.name}'") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise KVLedgerError(f"{p} is not a step profile ({type(err).__name__}); "
                                "write one with 'kvledger calibrate'") from None
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise KVLedgerError(f"{p} is not a step profile (no kind {PROFILE_KIND!r}); write one with 'kvledger calibrate'")
        if data.get("version") != PROFILE_VERSION:
            raise KVLedgerError(f"{p} is a version {data.get('version')} profile; this kvledger reads version "
                                f"{PROFILE_VERSION}: calibrate again")
        try:
            fields = {k: v for k, v in data.items() if k not in ("kind", "version")}
            fields["fingerprint"] = ModelFingerprint(**fields["fingerprint"])
            profile = cls(**fields)
            coef = {str(k): float(v) for k, v in profile.coefficients.items()}
        except (TypeError, KeyError, ValueError) as err:
            raise KVLedgerError(f"{p} is a malformed step profile ({err})") from None
        bad = [k for k, v in coef.items() if k not in TERMS or not (math.isfinite(v) and v >= 0)]
        if bad:
            raise KVLedgerError(f"{p}: coefficient {bad[0]!r} is unknown or not a finite non-negative number")
        profile.coefficients = coef
        return profile

    def check_model(self, spec: ModelSpec, tensor_parallel_size: int) -> None:
        """Refuse to use this profile for another model or TP size (one line, the numbers). Another KV
        dtype is allowed: the KV terms are priced per byte."""
        if ModelFingerprint.of(spec) != self.fingerprint:
            raise KVLedgerError(f"the profile was measured on {self.model} ({self.device}), not {spec.name}: "
                                f"its step times do not apply; calibrate {spec.name} or simulate with --gpu")
        if tensor_parallel_size != self.tensor_parallel_size:
            raise KVLedgerError(f"the profile was measured at --tensor-parallel-size {self.tensor_parallel_size}, "
                                f"not {tensor_parallel_size}")

    def step_model(self, spec: ModelSpec, kv_cache_dtype: str, path: str | Path = "") -> StepModel:
        geo = ModelGeometry.of(spec, kv_cache_dtype, self.tensor_parallel_size)
        return StepModel(geo, dict(self.coefficients), f"profile:{Path(path).name or self.device}")


def fit_coefficients(rows: Sequence[Sequence[float]], seconds: Sequence[float], terms: Sequence[str],
                     relative: bool = True) -> dict[str, float]:
    """Non-negative least squares (``scipy.optimize.nnls``) of ``seconds`` on the ``terms`` columns
    of ``rows`` (each a full :data:`TERMS` vector). With ``relative`` every row is weighted by
    ``1 / seconds``, so short steps count as much as long ones (the error minimised is relative)."""
    import numpy as np
    from scipy.optimize import nnls

    idx = [TERMS.index(t) for t in terms]
    a = np.asarray(rows, dtype=float)[:, idx]
    b = np.asarray(seconds, dtype=float)
    w = 1.0 / np.maximum(b, 1e-9) if relative else np.ones_like(b)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of 1 and of 1e9 bytes: normalise first
    x, _ = nnls(a / scale * w[:, None], b * w, maxiter=50 * len(idx))
    return {t: float(v) for t, v in zip(terms, x / scale)}
