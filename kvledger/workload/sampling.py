"""Requests drawn from a trace, and their arrival times: one implementation for every replay.

``kvledger bench serve`` sends these requests to a real server and ``kvledger simulate`` feeds
them to the engine's scheduler on a virtual clock; with the same trace, ``num_prompts``,
``sample``, ``length_scale``, ``request_rate``, ``burstiness`` and ``seed`` both get the same
requests at the same times. Lengths are tokens, times seconds from the start of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvledger.errors import KVLedgerError
from kvledger.workload.traces import Trace


@dataclass
class SampledRequest:
    """One request to replay: lengths in tokens, the trace's arrival in seconds from its first
    request (None without timestamps), and Mooncake's prompt block ids (None without)."""

    input_len: int
    output_len: int
    arrival_s: float | None = None
    hash_ids: list[int] | None = None


def check_shared_prefix(tokens: int | None, prompt_tokens: int, prompts: str) -> None:
    """Refuse a shared prefix (``--shared-prefix-tokens``, tokens) longer than the prompts it starts:
    ``prompt_tokens`` is the prompt length (the mean over a trace, rounded as ``advise`` takes it),
    ``prompts`` names where it comes from. A prefix longer than the average prompt would make most
    requests nothing but the prefix: a typo, not a workload."""
    if tokens and tokens > prompt_tokens:
        raise KVLedgerError(f"--shared-prefix-tokens {tokens:,} exceeds {prompts} ({prompt_tokens:,} tokens): a shared "
                            f"prefix is the start of every prompt; give at most {prompt_tokens:,}")


def mean_prompt_tokens(prompts: Sequence[int] | np.ndarray) -> int:
    """The mean of ``prompts`` (tokens), rounded, at least 1: a trace's typical prompt for the
    planner's and the simulator's checks."""
    return max(1, round(float(np.mean(prompts)))) if len(prompts) else 1


def select(trace: Trace, num_prompts: int | None, *, seed: int, sample: str, length_scale: float,
           max_model_len: int | None = None) -> list[SampledRequest]:
    """``num_prompts`` rows (all rows for None), random with ``seed`` or the first ones, in trace
    order, lengths scaled (rounded up, at least 1 token).

    With ``max_model_len``, prompts are cut so that prompt + output fits (outputs are kept)."""
    n = len(trace) if num_prompts is None else num_prompts
    if n < 1:
        raise KVLedgerError(f"--num-prompts must be at least 1, got {n}")
    if sample == "random" and n < len(trace):
        rng = np.random.default_rng(seed)
        idx = sorted(rng.choice(len(trace), size=n, replace=False).tolist())
    else:
        idx = list(range(min(n, len(trace))))
    prompt, output = trace.prompt.tolist(), trace.output.tolist()
    arrival = trace.arrival_s.tolist() if trace.arrival_s is not None else None
    chosen = []
    for i in idx:
        inp = max(1, math.ceil(prompt[i] * length_scale))
        outp = max(1, math.ceil(output[i] * length_scale))
        if max_model_len is not None:
            if outp >= max_model_len:
                outp = max_model_len - 1
            inp = min(inp, max_model_len - outp)
        chosen.append(SampledRequest(inp, outp, arrival[i] if arrival is not None else None,
                                     trace.hash_ids[i] if trace.hash_ids is not None else None))
    return chosen


def arrival_times(n: int, request_rate: float | str, *, seed: int, burstiness: float = 1.0,
                  trace: list[SampledRequest] | None = None, time_scale: float = 1.0) -> list[float]:
    """Send times in seconds from the start.

    ``inf``: all at 0. A rate: gamma-distributed gaps with mean ``1/rate`` (Poisson for
    burstiness 1), rescaled so the last request goes out at ``n / rate`` as vLLM does.
    ``"trace"``: the requests' own arrivals divided by ``time_scale``.
    """
    if request_rate == "trace":
        if not trace or any(r.arrival_s is None for r in trace):
            raise KVLedgerError("--request-rate trace needs a trace with timestamps")
        start = min(r.arrival_s for r in trace)  # type: ignore[type-var]
        return [(r.arrival_s - start) / time_scale for r in trace]  # type: ignore[operator]
    rate = float(request_rate)
    if not rate > 0:  # also nan
        raise KVLedgerError(f"--request-rate must be positive, inf or 'trace', got {request_rate}")
    if math.isinf(rate):
        return [0.0] * n
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise KVLedgerError(f"--burstiness must be a positive number, got {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if not times[-1] > 0:  # a gamma shape so small that every gap underflows to zero
        raise KVLedgerError(f"--burstiness {burstiness:g} is so small that every gap between arrivals is zero; "
                            "give 0.01 or more (1 is Poisson)")
    times *= (n / rate) / times[-1]
    return times.tolist()


def sample_requests(trace: Trace, num_prompts: int | None, *, seed: int, sample: str = "random",
                    length_scale: float = 1.0, request_rate: float | str = "trace", burstiness: float = 1.0,
                    time_scale: float = 1.0, max_model_len: int | None = None
                    ) -> tuple[list[SampledRequest], list[float]]:
    """The requests of a replay and their send times (seconds from the start), as
    :func:`select` and :func:`arrival_times` give them."""
    requests = select(trace, num_prompts, seed=seed, sample=sample, length_scale=length_scale,
                      max_model_len=max_model_len)
    times = arrival_times(len(requests), request_rate, seed=seed, burstiness=burstiness, trace=requests,
                          time_scale=time_scale)
    return requests, times
