"""The capacity planner: how many users fit on a card, and which lever buys more.

Pure Python (numpy for traces): never imports torch. One concept per module:

* ``gpus``        -- the GPU catalog (memory as the device reports it, bandwidth, FLOP/s, SM).
* ``memory_wall`` -- vLLM's KV pool: total x utilization - weights - activations - non-torch - graphs.
* ``bandwidth``   -- bytes moved per decode step, step time, tokens/s and the KV/weights crossover.
* ``workload``    -- real traces: length histogram, percentiles, live tokens replayed over time.
* ``advise``      -- the levers ranked by expected gain for a scenario, each with its cost.
* ``plot``        -- optional matplotlib figures.
"""
