"""kvledger's CPU kernels: C++ sources (``csrc/``, every op schema declared in ``csrc/ops.cpp``),
their build per vector capability (:mod:`.cpu_kernels`), and one Python wrapper per kernel
(``supports(...)`` says when it takes its operands; the function runs it):

* :mod:`.paged_decode`, :mod:`.paged_prefill`: attention reading K/V where they lie in the pool;
* :mod:`.rms_norm`, :mod:`.rotary`, :mod:`.silu_and_mul`: one call where torch runs several ops;
* :mod:`.panel_linear`: products of a few rows against a weight packed in panels.

The layers (:mod:`kvledger.layers`) call the wrappers and fall back to torch's operators.
"""
