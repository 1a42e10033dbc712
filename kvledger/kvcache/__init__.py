"""The KV cache: bookkeeping (block pool, prefix cache, per-request tables, groups) and storage
(the pool tensors, plain and 8-bit). :mod:`.interface` states what each half offers.

Importing this package or its bookkeeping modules does not import torch (the simulator and the
planner use them); :mod:`.storage`, :mod:`.quantized_storage` and :mod:`.quantization` do.
"""
