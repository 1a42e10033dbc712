"""vLLM 0.19's start-up check for one max_model_len request, worked by hand: a sliding layer is
counted at its worst during chunked prefill (``SlidingWindowSpec.max_memory_usage_bytes``), not at
the window it keeps once decoding. Without it the planner said "fits" where vLLM refuses."""

from __future__ import annotations

import math

from kvledger.planner.gpus import get_gpu
from kvledger.planner.memory_wall import (check_max_model_len, max_concurrency, max_fitting_length, plan_memory,
                                          sequence_blocks, startup_max_model_len, startup_request_bytes, verdict)
from kvledger.spec import load_model_spec


def test_gemma_3_27b_at_its_context_by_hand():
    """62 layers, 10 full and 52 sliding over 1,024 tokens, 16 KV heads of 128, bf16: one layer's
    block of 16 tokens is 16 x 2 x 16 x 128 x 2 = 131,072 bytes. At 131,072 tokens with vLLM's
    8,192-token prefill chunk on an H100: 10 x 8,192 blocks + 52 x (ceil((1,024 - 1 + 8,192) / 16)
    + 1) = 52 x 577 blocks, 13.66 GiB; the decoding window needs 10 x 8,192 + 52 x 65 blocks."""
    spec = load_model_spec("gemma-3-27b-it")
    wall = plan_memory(spec, get_gpu("h100-80gb"), gpu_memory_utilization=0.86)
    assert wall.max_num_batched_tokens == 8192
    assert startup_request_bytes(spec, wall, 131_072) == (10 * 8192 + 52 * 577) * 131_072
    # the window fits in this pool, vLLM's start-up requirement does not: "does not fit", not "fits"
    assert sequence_blocks(spec, wall, 131_072) <= wall.num_blocks and max_fitting_length(spec, wall) == 131_072
    assert check_max_model_len(spec, wall, 131_072) is not None
    assert verdict(spec, wall, max_model_len=131_072).verdict == "does not fit"
    assert max_concurrency(spec, wall, 131_072) < 1  # vLLM's own line says so too
    longest = startup_max_model_len(spec, wall)
    assert startup_request_bytes(spec, wall, longest) <= wall.num_blocks * wall.block_bytes
    assert startup_request_bytes(spec, wall, longest + 1) > wall.num_blocks * wall.block_bytes
    assert check_max_model_len(spec, wall, longest) is None


def test_without_sliding_layers_the_start_up_check_is_the_block_count():
    spec = load_model_spec("llama-3.1-8b")
    wall = plan_memory(spec, get_gpu("l4"))
    for tokens in (1, 8192, 20_000):
        assert startup_request_bytes(spec, wall, tokens) == math.ceil(tokens / 16) * wall.block_bytes
    assert startup_max_model_len(spec, wall) == max_fitting_length(spec, wall) == wall.kv_tokens
