"""Workload sizing from a real request trace: lengths, live tokens over time, and the limits to set.

Readers (chosen by the file's header or keys):

* Azure LLM inference trace CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock strings).
* Mooncake JSONL: ``timestamp`` (integer ms from the start), ``input_length``, ``output_length``,
  ``hash_ids`` (ids of the prompt's 512-token blocks; equal ids are equal content).
* Generic CSV or JSONL: ``prompt_tokens,output_tokens[,timestamp]``; a numeric timestamp is in
  seconds, a string is an ISO 8601 date-time.

The replay: each request arrives at its timestamp and stays resident for its prefill
(``prompt x 2 x active parameters`` FLOPs at the card's dense bf16 rate times
``bandwidth.PREFILL_EFFICIENCY``) and then its decode (``output`` steps at the modelled step time),
holding its prompt and the tokens generated so far. The step time depends on the load, so it
is solved by fixed-point iteration on the time-averaged live tokens. Nothing queues: the
result is the demand on the pool over time, to be read against the pool.
Lengths are tokens, times seconds.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvledger.errors import KVLedgerError

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces."""
REPLAY_SAMPLES = 4096
"""Points of the time grid on which live tokens are sampled."""
HISTOGRAM_EDGES = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
PERCENTILES = (50, 90, 99)

_AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_GENERIC = ("prompt_tokens", "output_tokens", "timestamp")
_MOONCAKE = ("input_length", "output_length", "timestamp")


@dataclass
class Trace:
    """Requests of one trace, in arrival order. Lengths in tokens, arrivals in seconds from the first."""

    name: str
    format: str
    prompt: np.ndarray
    output: np.ndarray
    arrival_s: np.ndarray | None
    hash_ids: list[list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.prompt)

    @property
    def total(self) -> np.ndarray:
        return self.prompt + self.output

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if self.arrival_s is not None and len(self) else 0.0


# ------------------------------------------------------------------------------ readers
def read_trace(path: str | Path) -> Trace:
    """Read a trace file (Azure CSV, Mooncake JSONL, or generic CSV/JSONL)."""
    p = Path(path)
    if not p.is_file():
        raise KVLedgerError(f"no such trace file: {p}; give --workload a CSV or JSONL trace")
    try:
        with p.open(newline="", encoding="utf-8") as fh:
            first = fh.readline()
            fh.seek(0)
            if first.lstrip().startswith("{"):
                trace = _read_jsonl(fh, p)
            else:
                trace = _read_csv(fh, p)
    except UnicodeDecodeError:
        raise KVLedgerError(f"{p} is not a text file; give a CSV or JSONL trace") from None
    if not len(trace):
        raise KVLedgerError(f"{p} holds no requests")
    return trace


def _int_field(value: Any, line: int, key: str, path: Path, minimum: int) -> int:
    try:
        number = int(value)
        if isinstance(value, float) and value != number:
            raise ValueError
    except (TypeError, ValueError):
        raise KVLedgerError(f"{path}:{line}: {key} must be an integer number of tokens, got {value!r}") from None
    if number < minimum:
        raise KVLedgerError(f"{path}:{line}: {key} must be at least {minimum}, got {number}")
    return number


def _time_field(value: Any, line: int, path: Path, scale: float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) * scale
    text = str(value).strip()
    try:
        return float(text) * scale
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise KVLedgerError(f"{path}:{line}: timestamp {value!r} is neither a number nor an ISO date-time") from None


def _read_csv(fh, path: Path) -> Trace:
    reader = csv.reader(fh)
    header = [h.strip() for h in next(reader, [])]
    if all(c in header for c in _AZURE):
        fmt, (tname, pname, oname) = "azure", _AZURE
    elif all(c in header for c in _GENERIC[:2]):
        fmt, (pname, oname, tname) = "csv", _GENERIC
    else:
        raise KVLedgerError(f"{path}:1: unknown CSV header {','.join(header)!r}; expected "
                            "TIMESTAMP,ContextTokens,GeneratedTokens (Azure) or prompt_tokens,output_tokens[,timestamp]")
    ip, io = header.index(pname), header.index(oname)
    it = header.index(tname) if tname in header else None
    scale = 1.0
    prompts, outputs, times = [], [], []
    for line, row in enumerate(reader, start=2):
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise KVLedgerError(f"{path}:{line}: expected {len(header)} columns ({','.join(header)}), got {len(row)}")
        prompts.append(_int_field(row[ip], line, pname, path, 1))
        outputs.append(_int_field(row[io], line, oname, path, 0))
        if it is not None:
            times.append(_time_field(row[it], line, path, scale))
    return _trace(path, fmt, prompts, outputs, times if it is not None else None, None)


def _read_jsonl(fh, path: Path) -> Trace:
    prompts, outputs, times, hashes = [], [], [], []
    fmt = None
    for line, text in enumerate(fh, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as err:
            raise KVLedgerError(f"{path}:{line}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise KVLedgerError(f"{path}:{line}: expected a JSON object per line")
        if fmt is None:
            if "input_length" in row:
                fmt = "mooncake"
            elif "prompt_tokens" in row:
                fmt = "jsonl"
            else:
                raise KVLedgerError(f"{path}:{line}: unknown keys {sorted(row)}; expected input_length/output_length "
                                    "(Mooncake) or prompt_tokens/output_tokens")
        pkey, okey = ("input_length", "output_length") if fmt == "mooncake" else ("prompt_tokens", "output_tokens")
        if pkey not in row or okey not in row:
            raise KVLedgerError(f"{path}:{line}: missing {pkey if pkey not in row else okey}")
        prompts.append(_int_field(row[pkey], line, pkey, path, 1))
        outputs.append(_int_field(row[okey], line, okey, path, 0))
        if "timestamp" in row:
            times.append(_time_field(row["timestamp"], line, path, 1e-3 if fmt == "mooncake" else 1.0))
        elif times:
            raise KVLedgerError(f"{path}:{line}: missing timestamp (earlier rows have one)")
        if fmt == "mooncake":
            ids = row.get("hash_ids")
            if not isinstance(ids, list):
                raise KVLedgerError(f"{path}:{line}: hash_ids must be a list of block ids")
            hashes.append(ids)
    return _trace(path, fmt or "jsonl", prompts, outputs, times or None, hashes or None)


def _trace(path: Path, fmt: str, prompts: list, outputs: list, times: list | None, hashes: list | None) -> Trace:
    prompt = np.asarray(prompts, dtype=np.int64)
    output = np.asarray(outputs, dtype=np.int64)
    arrival = None
    if times is not None and len(times) == len(prompts) and times:
        t = np.asarray(times, dtype=np.float64)
        order = np.argsort(t, kind="stable")
        arrival = t[order] - t[order][0]
        prompt, output = prompt[order], output[order]
        if hashes is not None:
            hashes = [hashes[i] for i in order]
    return Trace(name=path.name, format=fmt, prompt=prompt, output=output, arrival_s=arrival, hash_ids=hashes)


# ------------------------------------------------------------------------------ lengths
def percentiles(values: np.ndarray) -> dict[str, float]:
    """mean, p50, p90, p99 and max of ``values``."""
    out = {"mean": float(values.mean()), **{f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}}
    out["max"] = float(values.max())
    return out


def histogram(trace: Trace, edges: tuple[int, ...] = HISTOGRAM_EDGES) -> list[dict[str, Any]]:
    """Counts of prompt, output and total lengths per bin ``[lo, hi)``; the last bin is open."""
    bounds = np.asarray([*edges, np.iinfo(np.int64).max])
    rows = []
    counts = {k: np.histogram(v, bins=bounds)[0] for k, v in
              (("prompt", trace.prompt), ("output", trace.output), ("total", trace.total))}
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        rows.append({"lo": lo, "hi": hi, **{k: int(c[i]) for k, c in counts.items()}})
    return rows


def mean_live_tokens(trace: Trace) -> float:
    """Live tokens of an average request over its decode: its prompt plus half its output."""
    return float((trace.prompt + trace.output / 2).mean())


# ------------------------------------------------------------------------------ replay
@dataclass
class Replay:
    """Live tokens and resident sequences over the trace, sampled on a uniform time grid."""

    times_s: np.ndarray
    live_tokens: np.ndarray
    sequences: np.ndarray
    step_time_s: float
    prefill_s_per_token: float
    iterations: int

    def stats(self, pool_tokens: int) -> dict[str, Any]:
        busy = self.sequences > 0
        per_seq = float(self.live_tokens[busy].sum() / self.sequences[busy].sum()) if busy.any() else 0.0
        return {
            "live_tokens": percentiles(self.live_tokens),
            "sequences": percentiles(self.sequences),
            "live_tokens_per_sequence": per_seq,
            "time_over_pool": float((self.live_tokens > pool_tokens).mean()),
            "step_time_s": self.step_time_s,
            "prefill_s_per_token": self.prefill_s_per_token,
        }


def replay(trace: Trace, step_time_of: Callable[[float], float], prefill_s_per_token: float,
           samples: int = REPLAY_SAMPLES, iterations: int = 4) -> Replay | None:
    """Replay the arrivals; ``step_time_of(live_tokens)`` gives the decode step time (s).
    ``None`` when the trace has no timestamps."""
    if trace.arrival_s is None:
        return None
    step = step_time_of(0.0)
    for it in range(1, iterations + 1):
        times, live, seqs = _sample(trace, step, prefill_s_per_token, samples)
        new_step = step_time_of(float(live.mean()))
        converged = abs(new_step - step) <= 1e-3 * step
        step = new_step
        if converged:
            break
    times, live, seqs = _sample(trace, step, prefill_s_per_token, samples)
    return Replay(times, live, seqs, step, prefill_s_per_token, it)


def _sample(trace: Trace, step: float, prefill_s_per_token: float, samples: int):
    """Live tokens and sequences on a time grid, summed from difference arrays in O(n + samples).

    A request holds ``prompt`` tokens from arrival ``a`` to its end ``e`` and, from the end of
    its prefill ``d`` on, ``(t - d) / step`` generated tokens more."""
    a = trace.arrival_s
    d = a + trace.prompt * prefill_s_per_token
    e = d + trace.output * step
    times = np.linspace(float(a[0]), float(e.max()), samples)
    ia, id_, ie = (np.searchsorted(times, x, side="left") for x in (a, d, e))
    n = samples + 1
    level = np.zeros(n)
    count = np.zeros(n)
    slope = np.zeros(n)
    offset = np.zeros(n)
    np.add.at(level, ia, trace.prompt)
    np.add.at(level, ie, -trace.prompt)
    np.add.at(count, ia, 1)
    np.add.at(count, ie, -1)
    np.add.at(slope, id_, 1 / step)
    np.add.at(slope, ie, -1 / step)
    np.add.at(offset, id_, -d / step)
    np.add.at(offset, ie, d / step)
    live = (np.cumsum(level) + np.cumsum(slope) * np.append(times, 0) + np.cumsum(offset))[:samples]
    seqs = np.cumsum(count)[:samples]
    return times, np.maximum(np.rint(live), 0.0), np.rint(seqs)


# ------------------------------------------------------------------------------ prefixes
def prefix_savings(trace: Trace, shared_prefix_tokens: int | None = None) -> dict[str, Any] | None:
    """Prompt tokens prefix caching would not recompute (unbounded cache, trace order).

    With Mooncake ``hash_ids``: a request reuses its leading blocks already seen in an earlier
    request. With ``shared_prefix_tokens`` N: every request shares its first ``min(N, prompt)``
    tokens with the first request."""
    prompt_total = int(trace.prompt.sum())
    if shared_prefix_tokens:
        shared = np.minimum(trace.prompt, shared_prefix_tokens)
        saved = max(int(shared.sum()) - int(shared[0]), 0)
        source = f"--shared-prefix-tokens {shared_prefix_tokens}"
    elif trace.hash_ids is not None:
        saved, seen = 0, set()
        for length, ids in zip(trace.prompt.tolist(), trace.hash_ids):
            for i, block in enumerate(ids):
                if block not in seen:
                    break
                saved += min(MOONCAKE_BLOCK_TOKENS, length - i * MOONCAKE_BLOCK_TOKENS)
            seen.update(ids)
        source = f"hash_ids ({MOONCAKE_BLOCK_TOKENS}-token blocks)"
    else:
        return None
    return {"source": source, "prompt_tokens": prompt_total, "saved_tokens": saved,
            "saved_share": saved / prompt_total if prompt_total else 0.0}


# ------------------------------------------------------------------------------ limits
def recommend(trace: Trace, block_size: int, pool_tokens: int, live_per_sequence: float | None,
              model_max_len: int | None = None) -> dict[str, Any]:
    """``--max-model-len`` (p99 prompt + p99 output, rounded up to a block, at most the model's
    maximum) with the share of requests it rejects, and ``--max-num-seqs`` (the pool over the
    live tokens of an average resident sequence)."""
    p99 = float(np.percentile(trace.prompt, 99)) + float(np.percentile(trace.output, 99))
    max_len = math.ceil(p99 / block_size) * block_size
    if model_max_len:
        max_len = min(max_len, int(model_max_len))
    rejected = float((trace.total > max_len).mean())
    per_seq = live_per_sequence or mean_live_tokens(trace)
    return {"max_model_len": int(max_len), "rejected_share": rejected,
            "max_num_seqs": max(1, int(pool_tokens // max(per_seq, 1.0))), "live_tokens_per_sequence": per_seq}
