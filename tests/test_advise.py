"""``kvledger advise`` on the chapter's Design exercise and on scenarios that flip the verdict."""

from __future__ import annotations

import pytest

from kvledger.planner.advise import advise
from kvledger.planner.gpus import get_gpu
from kvledger.spec import load_model_spec
from tests.cli_helpers import assert_one_line_error, kvledger

CHAPTER = ("--gpu-memory", "80GiB", "--gpu-memory-utilization", "1.0", "--overhead", "3GiB")
DESIGN = ("llama-3.1-8b", "--gpu", "a100-80gb", "--prompt-tokens", "6144", "--output-tokens", "400",
          "--shared-prefix-tokens", "2048", "--users", "40", "--target-users", "100")


@pytest.fixture(scope="module")
def design():
    r = kvledger("advise", *DESIGN, *CHAPTER, "--json")
    assert r.returncode == 0, r.stderr
    return r.json()


def test_design_exercise_concurrency_binds(design):
    assert design["binding"] == "concurrency"
    assert 0.4 < design["pool_share_now"] < 0.6  # "roughly half the block pool"


def test_design_exercise_prefix_caching_first(design):
    names = [lever["name"] for lever in design["levers"]]
    assert names[0] == "prefix-caching"
    assert abs(design["duplicated_prefix_tokens"] - 200_000) <= 0.05 * 200_000
    assert abs(design["prefix_share_of_pool"] - 0.40) <= 0.03
    # the chapter's order for the rest: admission control, max-model-len, INT8 KV
    assert names.index("admission-control") < names.index("max-model-len") < names.index("kv-cache-int8")
    assert design["levers"][0]["users_after"] >= 100  # sharing the prefix alone makes 100 users fit


def test_design_exercise_offers_int8_not_fp8(design):
    names = [lever["name"] for lever in design["levers"]]
    assert "kv-cache-int8" in names
    assert not any("fp8" in name for name in names)
    assert any("SM 8.9" in note for note in design["notes"])


def test_fp8_offered_on_hopper():
    out = kvledger("advise", DESIGN[0], "--gpu", "h100-80gb", *DESIGN[3:], "--json").json()
    names = [lever["name"] for lever in out["levers"]]
    assert "kv-cache-fp8" in names and "kv-cache-int8" in names


def test_full_pool_means_capacity_binds():
    spec = load_model_spec("llama-3.1-8b")
    result = advise(spec, get_gpu("a100-80gb"), prompt_tokens=30000, output_tokens=2000, users=14, target_users=30)
    assert result.capacity_users <= 14 / 0.9 and result.binding == "capacity"
    admission = next(lv for lv in result.levers if lv.name == "admission-control")
    assert admission.gain_users <= 0 and admission.score == 0
    assert result.levers[0].gain_users > 0


def test_no_shared_prefix_gains_nothing_from_prefix_caching():
    spec = load_model_spec("llama-3.1-8b")
    result = advise(spec, get_gpu("a100-80gb"), prompt_tokens=6144, output_tokens=400, users=40, target_users=100)
    prefix = next(lv for lv in result.levers if lv.name == "prefix-caching")
    assert prefix.users_after == result.capacity_users
    assert result.levers[0].name != "prefix-caching"


def test_text_output_and_bad_input():
    r = kvledger("advise", *DESIGN, *CHAPTER)
    assert r.returncode == 0 and "concurrency, not capacity, binds" in r.stdout and "prefix-caching" in r.stdout
    bad = list(DESIGN)
    bad[bad.index("2048")] = "9000"
    assert_one_line_error(kvledger("advise", *bad), "--shared-prefix-tokens")
    assert_one_line_error(kvledger("advise", *DESIGN[:-1], "0"), "--target-users")


def test_prefix_caching_holds_the_prefix_once():
    """6,544 tokens a user (409 blocks of 16), 2,048 of them (128 blocks) shared: after sharing,
    each user adds 281 blocks to the 128 held once."""
    from kvledger.planner.memory_wall import plan_memory

    spec, gpu = load_model_spec("llama-3.1-8b"), get_gpu("a100-80gb")
    result = advise(spec, gpu, prompt_tokens=6144, output_tokens=400, shared_prefix_tokens=2048, users=40,
                    target_users=100)
    blocks = plan_memory(spec, gpu).num_blocks
    prefix = next(lv for lv in result.levers if lv.name == "prefix-caching")
    assert result.capacity_users == blocks // 409
    assert prefix.users_after == (blocks - 128) // 281


def test_tensor_parallel_lever_and_flags():
    out = kvledger("advise", *DESIGN, "--json").json()
    tp = next(lv for lv in out["levers"] if lv["name"] == "tensor-parallel")
    assert tp["flag"] == "--tensor-parallel-size 2"
    few = kvledger("advise", *DESIGN, "--max-num-seqs", "1", "--json").json()
    assert few["kv_pool_bytes"] > out["kv_pool_bytes"]  # a smaller sampler in the profiling pass
    assert_one_line_error(kvledger("advise", *DESIGN, "-tp", "3"), "tensor-parallel size 3 cannot split")
