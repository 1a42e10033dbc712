"""``kvledger advise`` on the chapter's Design exercise and on scenarios that flip the verdict."""

from __future__ import annotations

import pytest

from kvledger.errors import KVLedgerError
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


def test_design_exercise_admission_first_then_what_grows_the_pool(design):
    """By hand: 31,765 blocks of 16; a user is 6,544 tokens = 409 blocks, so the pool holds 77 and
    40 are admitted: admission control adds 37. While it is not lifted nothing else adds a user;
    once it is, prefix caching serves (31,765 - 128) // 281 = 112 (>= the target 100, +23 over
    admission alone, cost 1.0), int8 ~152 (+23 x 0.45), TP 2 (+23 x 0.3), shorter contexts
    (+23 x 0.25), and --max-model-len 6,544 adds nothing over admission (77)."""
    names = [lever["name"] for lever in design["levers"]]
    assert names == ["admission-control", "prefix-caching", "kv-cache-int8", "tensor-parallel", "shorter-contexts",
                     "max-model-len"]
    by = {lever["name"]: lever for lever in design["levers"]}
    assert by["admission-control"]["users_after"] == 77 and by["admission-control"]["gain"] == 37
    assert by["admission-control"]["flag"] == "--max-num-seqs 77"  # no hidden change of utilization
    for name in names[1:]:
        assert by[name]["gain"] == 0 and by[name]["users_after"] == 40, name
    assert by["prefix-caching"]["users_after_with_admission"] == (31_765 - 128) // 281 == 112
    assert by["max-model-len"]["users_after_with_admission"] == 77


def test_design_exercise_offers_int8_not_fp8(design):
    names = [lever["name"] for lever in design["levers"]]
    assert "kv-cache-int8" in names
    assert not any("fp8" in name for name in names)
    assert any("SM 8.9" in note for note in design["notes"])


def scenario(model, gpu, **kw):
    return advise(load_model_spec(model), get_gpu(gpu), **kw)


def order(result):
    return [lv.name for lv in result.levers]


def gains(result):
    return {lv.name: lv.gain for lv in result.levers}


def test_scenario_capacity_binds_without_a_prefix():
    """Llama-3.1-8B on an A100, 32,000-token users: the pool holds 14, 14 are served, 30 wanted.
    By hand, each lever alone: int8 (66,560 B a token with its float16 scales against 131,072 B)
    takes the pool from 14.21 users' worth to 27.99, so 27 users (+13 x 0.45 = 5.85); TP 2 gives 31
    (+16, capped at the target, x 0.3 = 4.8), halving the prompt gives 26 (+12 x 0.25 = 3.0),
    utilization 0.9 -> 0.95 one more (+1 x 0.85); admission, prefix caching (no prefix) and
    --max-model-len 32,000 (the requests' own length) add nothing."""
    r = scenario("llama-3.1-8b", "a100-80gb", prompt_tokens=30000, output_tokens=2000, users=14, target_users=30)
    assert r.binding == "capacity" and r.capacity_users == 14
    assert order(r)[:4] == ["kv-cache-int8", "tensor-parallel", "shorter-contexts", "gpu-memory-utilization"]
    g = gains(r)
    assert (g["kv-cache-int8"], g["tensor-parallel"], g["shorter-contexts"], g["gpu-memory-utilization"]) == (13, 16, 12, 1)
    assert g["admission-control"] == g["prefix-caching"] == g["max-model-len"] == 0


def test_scenario_target_already_met():
    r = scenario("llama-3.1-8b", "a100-80gb", prompt_tokens=2000, output_tokens=200, users=50, target_users=40)
    assert r.target_met and all(lv.gain == 0 and lv.score == 0 for lv in r.levers)
    assert "already met" in r.notes[0]


def test_scenario_capacity_binds_with_a_shared_prefix():
    """20,000 of the 32,000 tokens are a shared prefix: held once, each user adds 12,000 tokens
    (750 blocks) beside the 1,250 shared ones: 36 users from the same pool, free (cost 1.0),
    ahead of int8 (+14 x 0.45) and TP (+16 x 0.3)."""
    r = scenario("llama-3.1-8b", "a100-80gb", prompt_tokens=30000, output_tokens=2000, shared_prefix_tokens=20000,
                 users=14, target_users=30)
    from kvledger.planner.memory_wall import plan_memory

    blocks = plan_memory(load_model_spec("llama-3.1-8b"), get_gpu("a100-80gb")).num_blocks
    prefix = r.levers[0]
    assert prefix.name == "prefix-caching" and prefix.users_after == (blocks - 1250) // 750 == 36
    assert prefix.gain == 16  # capped at the target
    assert order(r)[1:3] == ["kv-cache-int8", "tensor-parallel"]


def test_scenario_hopper_offers_fp8_ahead_of_int8():
    """On an H100 both 8-bit caches double the blocks (13 users of 64,000 tokens instead of 6);
    fp8 keeps no per-token scales and costs less to validate (0.5 against 0.45): fp8 first."""
    r = scenario("llama-3.1-8b", "h100-80gb", prompt_tokens=60000, output_tokens=4000, users=7, target_users=20)
    assert r.binding == "capacity"
    assert order(r)[:2] == ["kv-cache-fp8", "kv-cache-int8"]
    assert gains(r)["kv-cache-fp8"] == gains(r)["kv-cache-int8"] == 7 and not r.notes


def test_scenario_low_utilization_is_its_own_lever():
    """At --gpu-memory-utilization 0.7 the pool holds 9 users of 32,000 tokens; raising it to 0.95
    gives 14 (+5 x 0.85 = 4.25), behind the 8-bit caches (+10) and ahead of TP 2 (+13 x 0.3 = 3.9);
    the admission lever never touches the utilization."""
    r = scenario("llama-3.1-8b", "h100-80gb", prompt_tokens=30000, output_tokens=2000, users=10, target_users=30,
                 gpu_memory_utilization=0.7)
    assert order(r)[:4] == ["kv-cache-fp8", "kv-cache-int8", "gpu-memory-utilization", "tensor-parallel"]
    util = next(lv for lv in r.levers if lv.name == "gpu-memory-utilization")
    assert util.users_after == 14 and util.gain == 5 and util.flag == "--gpu-memory-utilization 0.95"
    admission = next(lv for lv in r.levers if lv.name == "admission-control")
    assert "utilization" not in admission.flag and admission.gain == 0


def test_scenario_concurrency_binds_without_a_prefix():
    """No shared prefix: prefix caching adds nothing, now or once admission is lifted."""
    r = scenario("llama-3.1-8b", "a100-80gb", prompt_tokens=6144, output_tokens=400, users=40, target_users=100)
    assert r.binding == "concurrency" and r.levers[0].name == "admission-control"
    prefix = next(lv for lv in r.levers if lv.name == "prefix-caching")
    assert prefix.gain == 0 and prefix.users_after_with_admission == r.capacity_users


def test_scenario_max_model_len_never_above_the_models_context():
    """phi-4 has a 16,384-token context: a 13,000-token user gets --max-model-len 13,008 (a block
    multiple), and a user longer than the context is refused in one line."""
    r = scenario("phi-4", "h100-80gb", prompt_tokens=12000, output_tokens=1000, users=10, target_users=40)
    assert r.binding == "concurrency" and order(r)[0] == "admission-control" and gains(r)["admission-control"] == 6
    flag = next(lv.flag for lv in r.levers if lv.name == "max-model-len")
    assert flag == "--max-model-len 13008"
    with pytest.raises(KVLedgerError, match="16,384"):
        scenario("phi-4", "h100-80gb", prompt_tokens=16000, output_tokens=1000, users=10, target_users=40)


def test_no_gain_is_ever_negative():
    for users, target in ((5, 3), (40, 100), (200, 10), (14, 30)):
        r = scenario("llama-3.1-8b", "a100-80gb", prompt_tokens=30000, output_tokens=2000, users=users,
                     target_users=target)
        assert all(lv.gain >= 0 and lv.score >= 0 for lv in r.levers), (users, target)


def test_advise_takes_a_workload(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("prompt_tokens,output_tokens,timestamp\n" + "".join(f"6144,400,{i}\n" for i in range(10)))
    out = kvledger("advise", "llama-3.1-8b", "--gpu", "a100-80gb", "--workload", str(f), "--users", "40",
                   "--target-users", "100", "--json").json()
    assert out["tokens_per_user"] == 6544 and out["binding"] == "concurrency"
    assert_one_line_error(kvledger("advise", "llama-3.1-8b", "--gpu", "a100-80gb", "--users", "4",
                                   "--target-users", "5"), "--prompt-tokens")


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
    assert prefix.users_after_with_admission == (blocks - 128) // 281
    assert prefix.users_after == 40  # concurrency binds: admission stays at today's 40


def test_tensor_parallel_lever_and_flags():
    out = kvledger("advise", *DESIGN, "--json").json()
    tp = next(lv for lv in out["levers"] if lv["name"] == "tensor-parallel")
    assert tp["flag"] == "--tensor-parallel-size 2"
    few = kvledger("advise", *DESIGN, "--max-num-seqs", "1", "--json").json()
    assert few["kv_pool_bytes"] > out["kv_pool_bytes"]  # a smaller sampler in the profiling pass
    assert_one_line_error(kvledger("advise", *DESIGN, "-tp", "3"), "tensor-parallel size 3 cannot split")


def test_tensor_parallel_lever_offers_only_sizes_vllm_runs():
    """SmolLM2's 3 KV heads split over 2 ranks only unevenly (kvledger's engine runs it, vLLM does
    not), and 4 and 8 ranks not at all: no tensor-parallel lever, and TP 2 is refused."""
    args = ("smollm2-135m", "--gpu", "l4", "--prompt-tokens", "6144", "--output-tokens", "400", "--users", "40",
            "--target-users", "20000", "--json")
    out = kvledger("advise", *args).json()
    assert "tensor-parallel" not in [lv["name"] for lv in out["levers"]]
    assert_one_line_error(kvledger("advise", *args, "-tp", "2"), "evenly, as vLLM requires; sizes that do: 1, 3, 9")
