"""The compiled model step: ``torch.compile`` (inductor) of the decoder layer, attention left opaque.

What is compiled: one decoder layer's dense work (the norms, the projections, RoPE, SiLU-and-mul,
the residual adds), as one graph that every layer of the model runs with its own weights: the
layers share their code and their weights are graph inputs, so the graph is traced and built
once, not once per layer (a whole-model graph took 30x longer to build for the same kernels).
Attention over the paged cache is the custom operator ``kvledger::paged_attention``
(:mod:`kvledger.layers.attention`): it reads the step's metadata and the layer it serves from a
context set around the forward pass, so block tables, context lengths and decode groups never
enter the graph or its guards (vLLM's CPU backend does the same with its "forward context").
The embedding lookup and the LM head stay eager (one product each).

Shapes: the token count ``N`` of a step is symbolic, so one graph serves every batch, except
that torch specializes sizes of 1: a batch-1 decode step gets a graph of its own (vLLM captures
its sizes apart too). So two graphs are ever built, and a decode step never recompiles once
both were seen; the number of blocks a step reads is the attention operator's business.

When: only when asked for, with ``KVLEDGER_COMPILE=1`` in the environment, and never under
``enforce_eager`` (vLLM's ``--enforce-eager``). vLLM compiles by default; kvledger does not yet:
on quiet cores the compiled step gave float32 14-25% more throughput (BENCHMARKS.md), but the
first step of each of the two shapes pays the compile (tens of seconds on 2 cores; less when
inductor's on-disk cache already holds the kernels), which a short ``generate`` never earns
back. Under the compiled step the layers multiply by the plain weights
(:attr:`kvledger.layers.linear.Linear.kernel_weight`).
The tests of the compiled path set the variable.
If compiling fails (no C++ compiler,
an operator inductor cannot lower), the layers run eagerly from then on and the reason is
logged; the failed step is rerun eagerly (its K/V writes go to the same slots with the same
values, so a partial first attempt changes nothing).
"""

from __future__ import annotations

import logging
import os

import torch

from kvledger.layers.attention import AttentionMetadata, attention_step
from kvledger.kvcache.storage import KVCache

COMPILE_ENV = "KVLEDGER_COMPILE"

log = logging.getLogger("kvledger.engine")


def compile_enabled(enforce_eager: bool) -> bool:
    """True when the step should be compiled: ``KVLEDGER_COMPILE=1`` and not ``enforce_eager``."""
    return not enforce_eager and os.environ.get(COMPILE_ENV, "0") == "1"


class ModelStep:
    """The model's forward as the runner calls it, ``(input_ids, positions, meta, cache,
    logits_indices) -> logits``, with its decoder layers compiled or eager."""

    def __init__(self, model: torch.nn.Module, compiled: bool) -> None:
        self.model = model
        self.compiled = compiled
        if compiled:
            model.trims_last_layer = False  # one graph for every layer, the last one included
            for layer in model.layers:
                layer.compile(dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        try:
            with attention_step(meta, cache):
                return self.model(input_ids, positions, meta, cache, logits_indices)
        except Exception as err:  # noqa: BLE001 - a compile failure: eager from now on
            if not (self.compiled and _is_compile_error(err)):
                raise
            log.warning("torch.compile of the decoder layer failed, running eagerly: %s",
                        str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            self.eager()
            with attention_step(meta, cache):
                return self.model(input_ids, positions, meta, cache, logits_indices)

    def eager(self) -> None:
        """Run the layers eagerly from now on."""
        for layer in self.model.layers:
            layer._compiled_call_impl = None  # what nn.Module.compile() set
        self.model.trims_last_layer = True
        self.compiled = False


def _is_compile_error(err: Exception) -> bool:
    """True for errors raised while compiling (before the graph ran), not by the step itself."""
    from torch._dynamo import exc

    return isinstance(err, (exc.BackendCompilerFailed, exc.Unsupported, exc.TorchRuntimeError,
                            exc.InternalTorchDynamoError))
