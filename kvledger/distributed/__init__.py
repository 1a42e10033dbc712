"""Tensor parallelism on torch.distributed: the process group, rank launch and the step broadcast.

:mod:`.parallel_state` holds this process's rank and the collectives the parallel layers call;
:mod:`.executor` spawns the ranks and drives them from rank 0 (the engine's process).
"""
