"""Request traces: one reader for every trace the project takes, chosen by the file's header or keys.

* Azure LLM inference trace CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock strings).
* Mooncake JSONL: ``timestamp`` (integer ms from the start), ``input_length``, ``output_length``,
  and optionally ``hash_ids`` (ids of the prompt's 512-token blocks; equal ids are equal content).
* Generic CSV or JSONL: a prompt-length and an output-length column (``prompt_tokens`` or
  ``input_len``..., ``output_tokens`` or ``output_len``...) and optionally ``timestamp``; a numeric
  timestamp is in seconds, a string is an ISO 8601 date-time.

Lengths are tokens, times seconds. The planner sizes from a :class:`Trace`; ``kvledger bench
serve`` and the simulator draw their requests from one (``kvledger.workload.sampling``).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.errors import KVLedgerError, parse_json, shorten

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces."""

_AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
PROMPT_KEYS = ("prompt_tokens", "input_len", "input_length", "prompt_len", "context_tokens")
"""Column names a generic trace may give its prompt lengths under (the first found is used)."""
OUTPUT_KEYS = ("output_tokens", "output_len", "output_length", "completion_tokens", "generated_tokens")
"""Column names a generic trace may give its output lengths under."""
TIME_KEY = "timestamp"


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
    try:
        found = p.is_file()
    except OSError:  # a name longer than the file system takes
        found = False
    if not found:
        raise KVLedgerError(f"no such trace file: {shorten(str(p))}; give --workload a CSV or JSONL trace")
    try:
        with p.open(newline="", encoding="utf-8") as fh:
            first = fh.readline()
            while first and not first.strip():
                first = fh.readline()
            fh.seek(0)
            if not first:
                raise KVLedgerError(f"{p} is empty; a trace needs a header (CSV) or one JSON object per line")
            if first.lstrip().startswith("{") or p.suffix == ".jsonl":
                trace = _read_jsonl(fh, p)
            else:
                trace = _read_csv(fh, p)
    except UnicodeDecodeError:
        raise KVLedgerError(f"{p} is not a text file; give a CSV or JSONL trace") from None
    except OSError as err:
        raise KVLedgerError(f"cannot read the trace {p}: {err.strerror or err}") from None
    if not len(trace):
        raise KVLedgerError(f"{p} holds no requests")
    return trace


def _first(names, keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` that ``names`` (a header or a row's keys) holds."""
    return next((k for k in keys if k in names), None)


MAX_REQUEST_TOKENS = 2**31 - 1
"""The most tokens a trace row may give (int32: more than any model's context)."""


def _int_field(value: Any, line: int, key: str, path: Path, minimum: int) -> int:
    try:
        number = int(value)
        if isinstance(value, float) and value != number:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise KVLedgerError(f"{path}:{line}: {key} must be an integer number of tokens, got {value!r}") from None
    if number < minimum:
        raise KVLedgerError(f"{path}:{line}: {key} must be at least {minimum}, got {number}")
    if number > MAX_REQUEST_TOKENS:
        raise KVLedgerError(f"{path}:{line}: {key} = {number:.3g} tokens is more than any model's context "
                            f"(at most {MAX_REQUEST_TOKENS:,})")
    return number


def _time_field(value: Any, line: int, path: Path, scale: float) -> float:
    """Row ``line``'s timestamp in seconds: a number (times ``scale``) or an ISO 8601 date-time."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value).strip()
    try:
        seconds = float(number) * scale
    except OverflowError:  # an integer beyond any float
        seconds = math.inf
    except ValueError:
        try:
            return datetime.fromisoformat(number).timestamp()
        except ValueError:
            raise KVLedgerError(f"{path}:{line}: timestamp {value!r} is neither a number nor an ISO date-time") from None
    return _finite_time(seconds, value, line, path)


def _finite_time(seconds: float, value: Any, line: int, path: Path) -> float:
    """``seconds`` if it is a finite number; NaN or infinity (``nan``, ``inf``, JSON's ``NaN``) is no
    time a request arrives at: a KVLedgerError naming the row."""
    if not math.isfinite(seconds):
        raise KVLedgerError(f"{path}:{line}: timestamp {value!r} is not a finite number; give each row a time "
                            "in seconds (ms in Mooncake traces) or an ISO date-time")
    return seconds


def _read_csv(fh, path: Path) -> Trace:
    reader = csv.reader(fh)
    header = [h.strip() for h in next(reader, [])]
    pname, oname = _first(header, PROMPT_KEYS), _first(header, OUTPUT_KEYS)
    if all(c in header for c in _AZURE):
        fmt, (tname, pname, oname) = "azure", _AZURE
    elif pname and oname:
        fmt, tname = "csv", TIME_KEY
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
            row = parse_json(text)
        except json.JSONDecodeError as err:
            raise KVLedgerError(f"{path}:{line}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise KVLedgerError(f"{path}:{line}: expected a JSON object per line")
        if fmt is None:
            if "input_length" in row and "output_length" in row:
                fmt, pkey, okey = "mooncake", "input_length", "output_length"
            elif _first(row, PROMPT_KEYS) and _first(row, OUTPUT_KEYS):
                fmt, pkey, okey = "jsonl", _first(row, PROMPT_KEYS), _first(row, OUTPUT_KEYS)
            else:
                raise KVLedgerError(f"{path}:{line}: unknown keys {sorted(row)}; expected input_length/output_length"
                                    " (Mooncake) or prompt_tokens/output_tokens")
        if pkey not in row or okey not in row:
            raise KVLedgerError(f"{path}:{line}: missing {pkey if pkey not in row else okey}")
        prompts.append(_int_field(row[pkey], line, pkey, path, 1))
        outputs.append(_int_field(row[okey], line, okey, path, 0))
        if "timestamp" in row:
            times.append(_time_field(row["timestamp"], line, path, 1e-3 if fmt == "mooncake" else 1.0))
        elif times:
            raise KVLedgerError(f"{path}:{line}: missing timestamp (earlier rows have one)")
        if fmt == "mooncake":
            ids = row.get("hash_ids", [])
            if not isinstance(ids, list):
                raise KVLedgerError(f"{path}:{line}: hash_ids must be a list of block ids")
            hashes.append(ids)
    if not any(hashes):
        hashes = []  # Mooncake rows without hash_ids: lengths and times only
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
