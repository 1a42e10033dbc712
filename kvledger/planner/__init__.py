"""The capacity planner: how many users fit on a card, and which lever buys more.

Pure Python (numpy for traces): never imports torch. One concept per module:

* ``gpus``         -- the GPU catalog (memory as the device reports it, bandwidth, FLOP/s, SM).
* ``memory_wall``  -- vLLM's KV pool: total x utilization - weights - activations - non-torch; the
                    headroom outside it (CUDA graphs, warm-up) and the verdict.
* ``bandwidth``    -- bytes moved per decode step (MoE: the experts a batch touches), step time,
                    tokens/s and the KV/weights crossover.
* ``trace_sizing`` -- a real trace (read by ``kvledger.workload``) sized: length histogram,
                    percentiles, live tokens replayed over time, the limits to set.
* ``capacity``     -- the plan: :func:`plan` (``kvledger plan``) assembles the above into a
                    :class:`Plan` for a model, a card and a :class:`kvledger.config.PlannerConfig`.
* ``advise``       -- the levers ranked by the users they add given what binds, each with its cost.
* ``validation``   -- the planner against vLLM's own start-up logs (tests/data, bench/bench_validation.py).
* ``plot``         -- optional matplotlib figures.
"""

from kvledger.planner.capacity import Plan, plan

__all__ = ["Plan", "plan"]
