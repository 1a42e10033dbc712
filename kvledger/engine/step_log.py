"""The engine's per-step record as a file: one JSON line per :class:`StepRecord`.

``kvledger serve --step-log FILE`` hands the engine a :class:`StepLog` as its ``step_records``
(the engine only appends to it), so a serving run leaves the batch composition, tokens and
times of every step it ran; ``kvledger calibrate --step-log FILE`` fits the simulator's step
model from them. The first line is a header naming the model and the engine's pool.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from kvledger.engine.outputs import Arrival, StepRecord
from kvledger.errors import KVLedgerError

STEP_LOG_KIND = "kvledger-step-log"


class StepLog:
    """An append-only sink of step records: each one a JSON line, flushed as it is written."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        try:
            self._file: TextIO = self.path.open("w", buffering=1)
        except OSError as err:
            raise KVLedgerError(f"cannot write the step log {self.path}: {err.strerror or err}") from None
        self._write({"kind": STEP_LOG_KIND, **header})
        self.count = 0

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def append(self, record: StepRecord) -> None:
        self._write(asdict(record))
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def close(self) -> None:
        self._file.close()


def _arrival(fields: list) -> Arrival:
    """An :class:`Arrival` from its JSON list (a log written before ``received_s`` has four fields)."""
    rid, prompt, max_tokens, taken, *received = fields
    return Arrival(str(rid), int(prompt), int(max_tokens), float(taken),
                   float(received[0]) if received and received[0] is not None else None)


def read_step_log(path: str | Path) -> tuple[dict[str, Any], list[StepRecord]]:
    """(header, records) of a step log; a one-line :class:`KVLedgerError` if it is not one."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise KVLedgerError(f"no such step log: {p}; write one with 'kvledger serve --step-log {p.name}'") from None
    except (OSError, UnicodeDecodeError) as err:
        raise KVLedgerError(f"cannot read the step log {p}: {err}") from None
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("kind") != STEP_LOG_KIND:
        raise KVLedgerError(f"{p} is not a step log (no {STEP_LOG_KIND!r} header); "
                            "write one with 'kvledger serve --step-log FILE'")
    records = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            records.append(StepRecord(int(d["index"]), [(str(r), int(c), int(n)) for r, c, n in d["batch"]],
                                      int(d["num_samples"]), float(d["start_s"]), float(d["wall_s"]),
                                      float(d.get("model_s", 0.0)), [str(r) for r in d.get("preempted", [])],
                                      [_arrival(a) for a in d.get("arrivals", [])]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            if lineno == len(lines) and isinstance(err, json.JSONDecodeError):
                break  # a last line cut short (the server was killed while writing it)
            raise KVLedgerError(f"{p}:{lineno}: not a step record ({type(err).__name__}: {err})") from None
    return header, records
