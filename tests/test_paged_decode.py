"""In-place decode attention (kvledger/layers/paged_decode.py) against the gather plus SDPA it
replaces, on a tiny cache: padded tables, contexts that end inside a block, GQA."""

from __future__ import annotations

import pytest
import torch

from kvledger.layers.attention import DecodeGroup, decode_attention
from kvledger.layers.paged_decode import paged_decode_attention
from kvledger.layers.paged_kv import KVCache

BLOCKS, BS, H_KV, H, D = 12, 4, 2, 6, 8


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_reads_the_blocks_in_place_as_the_gather_would(dtype, tol):
    torch.manual_seed(0)
    cache = KVCache(1, BLOCKS, BS, H_KV, D, dtype)
    slots = torch.arange(BLOCKS * BS)
    cache.write(0, torch.randn(len(slots), H_KV, D), torch.randn(len(slots), H_KV, D), slots)
    # three sequences of 9, 3 and 12 tokens: 3, 1 and 3 blocks, padded with block 0
    tables = torch.tensor([[5, 2, 9], [7, 0, 0], [1, 11, 3]])
    lens = torch.tensor([9, 3, 12])
    q = torch.randn(3, H, D, dtype=dtype)
    gathered = decode_attention(q, cache.gather_decode(0, tables, 12), DecodeGroup.padding_mask(lens, 12, dtype), 0.35)
    in_place = paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35)
    assert in_place.dtype == dtype and in_place.shape == (3, H, D)
    torch.testing.assert_close(in_place.float(), gathered.float(), atol=tol, rtol=tol)
    # the second sequence sees only its 3 tokens: what lies past them in its blocks changes nothing
    cache.storage[0, :, 7, 3:] = 1e4
    cache.storage[0, :, 0] = -1e4
    again = paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35)
    torch.testing.assert_close(again[1], in_place[1])
