"""A served run's own clock for the simulator: its steps' recorded times and its requests' arrivals.

A replay runs the engine's scheduler and pool (the simulator's replica) with the recorded run's
timing in place of the step model, to check that they make the same decisions step for step.
For that the replay must see each request arrive between the same two steps as the engine did:

* **arrivals** are the times at which the engine took each request (:class:`Arrival` in the step
  records, on the engine's clock), not the times the load generator meant to send them: an HTTP
  hand-over of a few milliseconds can move a request past the start of a step;
* **step periods** run from one step's start to the next one's (``start_s[k+1] - start_s[k]``),
  idle time included, so step ``k`` of the replay starts at the virtual time the engine's step
  ``k`` started; the last step takes its ``wall_s``.

Virtual time 0 is the start of the first step; a request the engine took before it arrives at 0.
With the driver's rule (arrivals at an instant are added before the step that ends then
schedules), a request taken before step ``k`` began is in the replay's queue for step ``k``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Sequence

from kvledger.engine.outputs import Arrival, StepRecord
from kvledger.errors import KVLedgerError
from kvledger.sim.requests import SimRequest


def step_periods(records: Sequence[StepRecord]) -> list[float]:
    """Seconds from each step's start to the next one's (the last: its ``wall_s``)."""
    if not records:
        return []
    return [nxt.start_s - r.start_s for r, nxt in zip(records, records[1:])] + [records[-1].wall_s]


def recorded_arrivals(records: Sequence[StepRecord]) -> list[Arrival]:
    """Every request the recorded run took, in the order it took them."""
    return sorted((a for r in records for a in r.arrivals), key=lambda a: a.time_s)


def on_recorded_clock(requests: Sequence[SimRequest], records: Sequence[StepRecord]) -> list[SimRequest]:
    """``requests`` (the workload the run served) with the arrival times the engine recorded, in
    virtual seconds from the first step's start, in the order the engine took them (the order
    the driver adds them in). Each recorded
    arrival is matched, in the order the engine took them, to the earliest request of the workload
    not yet matched with the same prompt length and ``max_tokens``, and takes the engine's request
    id (so the replay's step records read like the run's); a one-line
    :class:`KVLedgerError` if the step log and the workload do not describe the same requests."""
    arrivals = recorded_arrivals(records)
    if not records or not arrivals:
        raise KVLedgerError("the step log records no arrivals: write it with this version's "
                            "'kvledger serve --step-log FILE'")
    if len(arrivals) != len(requests):
        raise KVLedgerError(f"the step log took {len(arrivals)} requests and the workload has {len(requests)}: "
                            "replay the workload the run served")
    by_shape: dict[tuple[int, int], deque[SimRequest]] = defaultdict(deque)
    for req in sorted(requests, key=lambda r: (r.arrival_time, r.uid)):
        by_shape[(req.prompt_len, req.output_len)].append(req)
    origin, taken = records[0].start_s, []
    for a in arrivals:
        waiting = by_shape.get((a.prompt_tokens, a.max_tokens))
        if not waiting:
            raise KVLedgerError(f"the step log's request {a.request_id} ({a.prompt_tokens} prompt tokens, "
                                f"max_tokens {a.max_tokens}) is not in the workload: replay the workload "
                                "the run served")
        req = waiting.popleft()
        req.arrival_time = max(0.0, a.time_s - origin)
        req.request_id = a.request_id
        taken.append(req)
    return taken  # in the engine's order, which is also the order of the times
