"""The inference engine: a paged KV cache, prefix caching and continuous batching.

``LLM`` (offline batches) and ``LLMEngine`` (one step at a time, for a server loop) are the
entry points. Modules are imported lazily by ``kvledger/__init__.py``; importing this package
does not import torch.

CPU threads: unless the environment says otherwise, waiting OpenMP threads spin for
``GOMP_SPINCOUNT=30000`` iterations before sleeping (libgomp's default is 300,000). On shared
cores, long spins by two busy processes make parallel regions wait for a descheduled thread.
Measured here for a batch-1 decode step: 22-24 ms alone with either setting; beside a second busy
process 42-200 ms with the default and 41-61 ms with 30,000; sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) cost 38 ms even alone. Takes effect only if torch is not imported yet.
"""

import os as _os

if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "30000")
