"""Every default is defined once, in ``kvledger.config``: each subcommand's flags take theirs from it."""

from __future__ import annotations

import argparse
import ast
from dataclasses import fields
from pathlib import Path

import pytest

import kvledger
from kvledger.cli.main import build_parser
from kvledger.config import (CUDA_BLOCK_SIZE, VLLM_BLOCK_SIZES, EngineConfig, PlannerConfig, SimulatorConfig)

ENGINE = EngineConfig()
PLANNER = PlannerConfig()
SIMULATOR = SimulatorConfig(model="")

#: Flags whose destination is not the config field's name.
PLANNER_FIELD = {"activation_memory": "activation", "non_torch_memory": "non_torch", "cuda_graph_memory": "cuda_graph"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def _expected(command: str) -> dict[str, object]:
    """dest -> the default the config gives it, for the flags of ``command`` that are config settings."""
    if command in ("generate", "serve"):
        return {f.name: getattr(ENGINE, f.name) for f in fields(EngineConfig) if f.name not in ("seed", "tokenizer")}
    if command in ("plan", "advise"):  # advise sizes its users from their tokens, not from --max-model-len
        names = {f.name for f in fields(PlannerConfig)} - ({"max_model_len"} if command == "advise" else set())
        return {dest: getattr(PLANNER, PLANNER_FIELD.get(dest, dest)) for dest in
                [*names - set(PLANNER_FIELD.values()), *PLANNER_FIELD]}
    if command == "simulate":
        return {f.name: getattr(SIMULATOR, f.name) for f in fields(SimulatorConfig) if f.name != "model"}
    if command == "kv-bytes":  # Eq 2.2 counted as the planner counts it, in blocks of the engine's CUDA size
        return {"block_size": CUDA_BLOCK_SIZE, "kv_cache_dtype": PLANNER.kv_cache_dtype,
                "tensor_parallel_size": PLANNER.tensor_parallel_size}
    if command == "calibrate":  # the engine it measures, in CUDA-sized blocks on every device
        return {"block_size": CUDA_BLOCK_SIZE, "max_num_batched_tokens": ENGINE.max_num_batched_tokens,
                "dtype": ENGINE.dtype, "device": ENGINE.device}
    if command == "kv-quality":
        return {"dtype": ENGINE.dtype}
    return {}


@pytest.mark.parametrize("command", ["generate", "serve", "plan", "advise", "simulate", "kv-bytes", "calibrate",
                                     "kv-quality"])
def test_each_flag_takes_its_default_from_the_config(command):
    flags = _flags(_subparsers()[command])
    expected = _expected(command)
    missing = sorted(set(expected) - set(flags))
    assert not missing, f"{command}: config settings without a flag: {missing}"
    wrong = {dest: (flags[dest].default, value) for dest, value in expected.items() if flags[dest].default != value}
    assert not wrong, f"{command}: flag default != config default: {wrong}"


def test_block_size_choices_are_vllms_wherever_they_are_restricted():
    seen = 0
    for command, parser in _subparsers().items():
        action = _flags(parser).get("block_size")
        if action is not None and action.choices is not None:
            assert tuple(action.choices) == VLLM_BLOCK_SIZES, command
            seen += 1
    assert seen >= 3  # generate, serve, plan (and advise)


#: Setting names whose values live in kvledger/config.py only.
SETTINGS = ("BLOCK_SIZE", "BLOCK_SIZES", "GPU_MEMORY_UTILIZATION", "MAX_NUM_SEQS", "MAX_NUM_BATCHED_TOKENS",
            "KV_CACHE_SHARE", "KV_CACHE_MAX")


def test_no_module_but_the_config_defines_a_setting_constant():
    """A second ``VLLM_BLOCK_SIZES = ...`` or ``DEFAULT_GPU_MEMORY_UTILIZATION = 0.9`` elsewhere fails."""
    root = Path(kvledger.__file__).parent
    twice = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "config.py":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                if isinstance(target, ast.Name) and target.id.isupper() and target.id.endswith(SETTINGS):
                    twice.append(f"{path.relative_to(root)}: {target.id}")
    assert not twice, twice
