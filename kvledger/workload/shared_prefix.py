"""A workload of requests that share a few long prefixes, interleaved at random: the case where the
router decides whether prefix caching survives a fleet.

One draw gives both forms of the same workload: token ids for a real server, and Mooncake-style
rows (``hash_ids`` of 512-token blocks, :data:`~kvledger.workload.traces.MOONCAKE_BLOCK_TOKENS`)
for ``kvledger simulate``, where a prefix of 512 tokens is one shared block id and each
request's own suffix one more.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SharedPrefixWorkload:
    """``order[i]`` is request ``i``'s prefix; ``prompts[i]`` its token ids (prefix + own suffix)."""

    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    order: list[int]
    prompts: list[list[int]]

    def write_mooncake(self, path: Path, gap_ms: int = 500) -> Path:
        """The same requests as a Mooncake JSONL trace, ``gap_ms`` apart (prefix = one block id)."""
        with open(path, "w") as f:
            for i, p in enumerate(self.order):
                row = {"timestamp": i * gap_ms, "input_length": self.prefix_tokens + self.suffix_tokens,
                       "output_length": self.output_tokens, "hash_ids": [p, len(self.order) + i]}
                f.write(json.dumps(row) + "\n")
        return path


def shared_prefix_workload(prefixes: int = 8, prefix_tokens: int = 512, requests: int = 64, suffix_tokens: int = 8,
                           output_tokens: int = 2, vocab: tuple[int, int] = (1000, 40000),
                           seed: int = 0) -> SharedPrefixWorkload:
    """``requests`` prompts, ``requests / prefixes`` per prefix, in a random (seeded) order; token
    ids drawn from ``vocab`` (a range)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(*vocab) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    order = [p for p in range(prefixes) for _ in range(requests // prefixes)]
    rng.shuffle(order)  # at random: a fixed period would let round-robin look affine
    prompts = [heads[p] + [rng.randrange(*vocab) for _ in range(suffix_tokens)] for p in order]
    return SharedPrefixWorkload(prefix_tokens, suffix_tokens, output_tokens, order, prompts)
