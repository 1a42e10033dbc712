"""Hybrid models in the simulator: requests hold their state blocks in vLLM's one pool.

A hybrid's request (``kvledger.spec.hybrid``) holds, in the pool of ``num_blocks`` blocks,
``cdiv(T, block_size)`` blocks in each attention group and a fixed number of blocks in each
state group: from its admission (the first allocation) to its finish; a preemption frees them
with the rest, and the request takes them again when it is admitted again. The scheduler and
the block pool are the engine's; only the manager knows about the extra blocks: the first
attention group's table is the engine's own, the other attention groups' blocks and the state
blocks sit beside it, allocated together (all or none).

Prefix-cache hits are not modeled for hybrids: vLLM reuses a hybrid prefix only at a block
whose state checkpoint is cached too ("align" mode), so the simulator admits every hybrid
request cold; prefix caching still sets the state blocks a request holds.
Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.kvcache.block_pool import BlockPool, blocks_for
from kvledger.kvcache.manager import KVCacheManager
from kvledger.errors import KVLedgerError


@dataclass(frozen=True)
class HybridPool:
    """What a hybrid request holds beyond one attention table (from the plan's wall)."""

    attention_groups: int
    state_groups: int
    state_blocks_per_group: int
    """Blocks a request holds in each state group (1 without prefix caching; see ``spec.hybrid``)."""

    @property
    def state_blocks(self) -> int:
        """State blocks one request holds from admission to finish."""
        return self.state_groups * self.state_blocks_per_group

    def blocks_per_request(self, tokens: int, block_size: int) -> int:
        return self.attention_groups * blocks_for(tokens, block_size) + self.state_blocks

    @classmethod
    def from_wall(cls, wall) -> "HybridPool":
        return cls(wall.attention_groups, wall.state_groups, wall.state_blocks_per_request)

    @classmethod
    def from_layout(cls, layout) -> "HybridPool":
        return cls(layout.attention_groups, layout.state_groups, layout.state_blocks_per_request)


def check_max_num_seqs(max_num_seqs: int, num_blocks: int, refuses: bool = True) -> None:
    """vLLM's start-up refusal (0.19+) when ``max_num_seqs`` exceeds the pool's blocks."""
    if refuses and max_num_seqs > num_blocks:
        raise KVLedgerError(f"max_num_seqs ({max_num_seqs}) exceeds available Mamba cache blocks ({num_blocks}): vLLM "
                            f"refuses to start; set --max-num-seqs {num_blocks} or less, or give the cache more memory")


class HybridKVCacheManager(KVCacheManager):
    """The engine's manager plus a hybrid request's other attention groups and its state blocks."""

    def __init__(self, pool: BlockPool, block_size: int, hybrid: HybridPool) -> None:
        super().__init__(pool, block_size)
        self.hybrid_pool = hybrid
        self.side: dict[str, list[int]] = {}
        """Per request: its state blocks and its blocks in the attention groups past the first."""

    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        return [], 0  # no hybrid prefix hits (see the module)

    def allocate_slots(self, request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        rid = request.request_id
        table = self.block_tables.get(rid)
        grow = max(0, blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
                   - (len(table) if table is not None else 0))
        extra = grow * (self.hybrid_pool.attention_groups - 1) + (0 if rid in self.side else self.hybrid_pool.state_blocks)
        if grow + extra > self.pool.num_free_blocks:
            return False
        if not super().allocate_slots(request, num_new_tokens):
            return False
        side = self.side.setdefault(rid, [])
        if extra:
            side.extend(self.pool.allocate(extra))
        return True

    def free(self, request) -> None:
        super().free(request)
        side = self.side.pop(request.request_id, None)
        if side:
            self.pool.free(reversed(side))

    def state_blocks_held(self) -> int:
        """State and extra attention-group blocks every request holds now."""
        return sum(len(s) for s in self.side.values())
