"""Tensor parallelism on torch.distributed: the process group, rank launch and the step broadcast.

:mod:`.parallel_state` holds this process's rank and the collectives the parallel layers call;
:mod:`.ranks` spawns the other ranks, each running a target the caller names (the engine's
:class:`~kvledger.engine.model_runner.ModelRunner`), and broadcasts a step's inputs to them.
Nothing here imports the engine or the models.
"""
