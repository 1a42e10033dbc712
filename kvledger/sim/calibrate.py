"""Calibration: run the real engine over a grid of batch shapes, fit the step model to its steps.

Every step the engine runs is a row: its :class:`StepRecord` gives the batch (context and new
tokens per request) and the times. The model-run terms are fitted to ``model_s`` and the CPU
terms to ``wall_s - model_s``, each by non-negative least squares on relative error, so the
CPU overhead between model runs is a coefficient of its own. Shapes:

* prefill chunks: ``n`` new tokens on ``c`` cached ones (the ``c`` come from a prefix-cache
  hit on a prompt run just before), one request per step;
* decode batches: ``B`` requests decoding at a context of ``T`` tokens (their prompts share all
  but their last block, so setting them up costs one prefill).

The module does not import torch: it drives any engine object with ``add_request``, ``step``,
``has_unfinished_requests`` and ``step_records`` (``LLMEngine``'s).
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np

from kvledger.engine.outputs import StepRecord
from kvledger.engine.step_log import read_step_log
from kvledger.errors import KVLedgerError
from kvledger.sim.step_model import (CPU_TERMS, TERMS, ModelFingerprint, ModelGeometry, Profile, batch_terms,
                                     fit_coefficients)
from kvledger.spec import ModelSpec

GPU_FIT_TERMS = ("step", "prefill_tokens", "prefill_attention", "decode_tokens", "kv_read_bytes", "requests")
"""Model-run terms a single-device dense fit can tell apart (weight bytes are constant per step
there, so ``step`` carries them; KV writes follow the token counts; no all-reduce at TP 1)."""


@dataclass(frozen=True)
class Shape:
    """One grid point: ``kind`` "prefill" (``tokens`` new on ``context`` cached) or "decode"
    (``batch`` requests at ``context`` tokens)."""

    kind: str
    context: int
    tokens: int = 1
    batch: int = 1

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.tokens} on {self.context}"
        return f"decode {self.batch} x {self.context}"


def grid(quick: bool, max_num_batched_tokens: int) -> list[Shape]:
    """The shapes to measure (``quick``: a few, for a fit in seconds)."""
    if quick:
        prefills = [(n, c) for n in (16, 128) for c in (0, 128)]
        decodes = [(b, t) for b in (1, 8) for t in (64, 256)]
    else:
        prefills = [(n, c) for n in (16, 64, 256, 512, 1024) for c in (0, 256, 1024)]
        decodes = [(b, t) for b in (1, 4, 16, 32, 64) for t in (64, 256, 1024)]
    shapes = [Shape("prefill", c, n) for n, c in prefills if n <= max_num_batched_tokens]
    shapes += [Shape("decode", t, 1, b) for b, t in decodes]
    return shapes


@dataclass
class Measured:
    """The engine's steps of one shape (``rows`` are terms vectors, in :data:`TERMS` order)."""

    shape: Shape
    records: list[StepRecord]
    rows: list[list[float]]


def measure(engine: Any, shapes: list[Shape], geometry: ModelGeometry, *, reps: int, vocab: int,
            max_model_len: int, sampling_params: Callable[[int], Any], progress: Callable[[str], None] | None = None,
            seed: int = 0) -> list[Measured]:
    """Run every shape ``reps`` times on ``engine``; the steps of that shape's batch, by shape.

    ``sampling_params(n)`` makes the engine's greedy, ``ignore_eos`` params for ``n`` tokens."""
    rng = random.Random(seed)
    counter = itertools.count()
    out = []

    def prompt(n: int) -> list[int]:
        return [rng.randrange(256, vocab) for _ in range(n)]

    def run(prompts: list[list[int]], max_tokens: int) -> list[StepRecord]:
        engine.step_records = records = []
        for p in prompts:
            engine.add_request(f"cal-{next(counter)}", p, sampling_params(max_tokens))
        while engine.has_unfinished_requests():
            engine.step()
        engine.step_records = None
        return records

    for shape in shapes:
        if progress:
            progress(shape.label)
        picked: list[StepRecord] = []
        for _ in range(reps):
            if shape.kind == "prefill":
                if shape.context + shape.tokens + 1 > max_model_len:
                    break
                base = prompt(shape.context)
                if shape.context:
                    run([base + prompt(1)], 1)  # caches the context's full blocks
                records = run([base + prompt(shape.tokens)], 1)
                picked += [r for r in records if r.batch and r.batch[0][2] == shape.tokens]
            else:
                if shape.context + 4 > max_model_len:
                    break
                shared = prompt(shape.context - 1)
                records = run([shared + prompt(1) for _ in range(shape.batch)], 4)
                picked += [r for r in records if len(r.batch) == shape.batch and all(n == 1 for _, _, n in r.batch)]
        rows = [batch_terms(geometry, [(c, n) for _, c, n in r.batch], r.num_samples) for r in picked]
        out.append(Measured(shape, picked, rows))
    return out


def _fit(rows: list[list[float]], model_s: list[float], cpu_s: list[float], gpu_terms,
         relative: bool = True) -> dict[str, float]:
    if not rows:
        from kvledger.errors import KVLedgerError

        raise KVLedgerError("calibration measured no steps; give the engine a longer --max-model-len")
    coef = {t: 0.0 for t in TERMS}
    for seconds, terms in ((model_s, gpu_terms), ([max(s, 1e-7) for s in cpu_s], CPU_TERMS)):
        for t, v in fit_coefficients(rows, seconds, terms, relative).items():
            coef[t] += v  # a term of both parts (arrivals) costs in both: the step's time is their sum
    return coef


def _error_row(coef: dict[str, float], rows: list[list[float]], measured_s: list[float], **what: Any) -> dict[str, Any]:
    """One line of the fit's report: medians of measured and predicted seconds of a group of steps."""
    c = np.asarray([coef[t] for t in TERMS])
    measured = float(np.median(measured_s))
    predicted = float(np.median(np.asarray(rows, float) @ c))
    return {**what, "steps": len(rows), "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
            "error_pct": (predicted - measured) / measured * 100}


def fit(measured: list[Measured], gpu_terms=GPU_FIT_TERMS) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Coefficients from every measured step, and the fit's error per shape (medians, percent)."""
    recs = [r for m in measured for r in m.records]
    coef = _fit([row for m in measured for row in m.rows], [r.model_s for r in recs],
                [r.wall_s - r.model_s for r in recs], gpu_terms)
    report = [_error_row(coef, m.rows, [r.wall_s for r in m.records], shape=m.shape.label, kind=m.shape.kind,
                         context=m.shape.context, tokens=m.shape.tokens, batch=m.shape.batch)
              for m in measured if m.rows]
    return coef, report


MAX_GAP_S = 1.0
"""A pause between two steps longer than this is not overhead (the loop waited for work)."""


def busy_pauses(records: list[StepRecord]) -> list[float]:
    """Per step of a serving run: the pause before the next step, where the engine was busy
    throughout (the next step carries on a request of this one and starts within
    :data:`MAX_GAP_S`), else 0. ``wall_s`` plus this pause is the step's period: the virtual
    seconds the simulator's clock advances for it."""
    pauses = []
    for r, nxt in zip(records, [*records[1:], None]):
        pause = 0.0
        if nxt is not None:
            gap = nxt.start_s - (r.start_s + r.wall_s)
            if 0 <= gap <= MAX_GAP_S and {b[0] for b in r.batch} & {b[0] for b in nxt.batch}:
                pause = gap
        pauses.append(pause)
    return pauses


def arrivals_received(records: list[StepRecord], pauses: list[float]) -> list[int]:
    """Per step of a serving run: how many requests the server received during its period (from
    its start to the end of its busy pause, :func:`busy_pauses`). A request received while the
    engine was idle counts on the step that took it, which started because of it. Arrivals
    without a receipt time (a log written before the server recorded it) count nowhere."""
    starts = [r.start_s for r in records]
    counts = [0] * len(records)
    for j, taker in enumerate(records):
        for a in taker.arrivals:
            if a.received_s is None:
                continue
            k = bisect.bisect_right(starts, a.received_s) - 1
            busy = k >= 0 and a.received_s < starts[k] + records[k].wall_s + pauses[k]
            counts[k if busy else j] += 1
    return counts


def fit_step_log(records: list[StepRecord], geometry: ModelGeometry, gpu_terms=GPU_FIT_TERMS
                 ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Coefficients from a serving run's own steps (``kvledger serve --step-log``), and the fit's
    error per kind of step (decode-only or with a prefill chunk, by batch size).

    The model terms are fitted to ``model_s``. The CPU terms are fitted to everything else of a
    step's period: ``wall_s - model_s`` plus the pause before the next step (the server's loop
    hands out tokens and takes new requests there), counted only where the next step carries on
    a request of this one, so the engine was busy throughout; other steps give the CPU fit
    ``wall_s - model_s`` alone. The error minimised is absolute, not relative: a serving run's
    steps are what they are (a grid has one of each shape), and with the constant terms the
    fitted steps then add up to the measured time, which sets the latencies. The report's last
    row compares those sums. The requests the server received during a step
    (:func:`arrivals_received`) are a term of both fits: receiving one takes the shared cores
    from the model run and from the CPU work around it."""
    rows, model_s, cpu_s, period_s, kinds = [], [], [], [], []
    pauses = busy_pauses(records)
    for r, gap, received in zip(records, pauses, arrivals_received(records, pauses)):
        if not r.batch:
            continue
        rows.append(batch_terms(geometry, [(c, n) for _, c, n in r.batch], r.num_samples, received))
        model_s.append(r.model_s)
        cpu_s.append(r.wall_s - r.model_s + gap)
        period_s.append(r.wall_s + gap)
        prefill = any(n > 1 for _, _, n in r.batch)
        size = 1 << (len(r.batch) - 1).bit_length()  # batch sizes by powers of two
        kinds.append(("prefill" if prefill else "decode", size))
    coef = _fit(rows, model_s, cpu_s, (*gpu_terms, "arrivals"), relative=False)
    report = []
    for kind, size in sorted(set(kinds)):
        idx = [j for j, k in enumerate(kinds) if k == (kind, size)]
        report.append(_error_row(coef, [rows[j] for j in idx], [period_s[j] for j in idx],
                                 shape=f"{kind}, batch <= {size}", kind=kind, batch=size))
    c = np.asarray([coef[t] for t in TERMS])
    total, predicted = float(np.sum(period_s)), float(np.sum(np.asarray(rows, float) @ c))
    report.append({"shape": "all steps (sum)", "kind": "total", "batch": 0, "steps": len(rows),
                   "measured_ms": total * 1e3, "predicted_ms": predicted * 1e3,
                   "error_pct": (predicted - total) / total * 100})
    return coef, report


def profile_from_step_log(path: str) -> tuple[Profile, list[dict[str, Any]]]:
    """(Profile, report): a step profile fitted from the records of a step log (``kvledger serve
    --step-log``), for the model and engine its header names; the report is :func:`fit_step_log`'s."""
    header, records = read_step_log(path)
    try:
        spec = ModelSpec.from_config_dict({**header["hf_config"], "torch_dtype": header["dtype"]},
                                          name=header["model"])
        kv_dtype, block_size, num_blocks = header["kv_cache_dtype"], int(header["block_size"]), int(header["num_blocks"])
    except (KeyError, TypeError, ValueError) as err:
        raise KVLedgerError(f"{path}: the step log's header lacks the model or the pool ({err})") from None
    if len(records) < 8:
        raise KVLedgerError(f"{path} holds {len(records)} steps; a fit needs a serving run of at least 8")
    coefficients, report = fit_step_log(records, ModelGeometry.of(spec, kv_dtype))
    profile = Profile(device=str(header.get("device", "unknown")), model=spec.name,
                      fingerprint=ModelFingerprint.of(spec), dtype=header["dtype"], kv_cache_dtype=kv_dtype,
                      tensor_parallel_size=1, block_size=block_size, num_blocks=num_blocks,
                      coefficients=coefficients, fit=report,
                      created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return profile, report
