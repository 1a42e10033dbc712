"""The CPU kernels' build step: one build per vector capability the CPU has, chosen per process or
switched inside one; a build killed halfway never makes a later load wait forever, and a process
that waits too long for another one's build, or runs with no capability, says so in one line and
falls back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvledger.kernels import cpu_kernels
from tests.conftest import CPU_CAPABILITY_FLAGS, cpu_flags

LOAD = ("from kvledger.kernels import cpu_kernels as c; ok = c.loaded(); "
        "print('loaded' if ok else 'not loaded: ' + c.reason())")


def _load_in_a_new_process(**env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def built() -> None:
    assert cpu_kernels.loaded(), cpu_kernels.reason()  # built once, so the loads below only link


def test_the_build_directory_is_keyed_by_the_sources_and_flags(built):
    here = cpu_kernels.build_directory()
    assert here.parent.name == cpu_kernels.NAME and len(here.name) == 16
    assert cpu_kernels.build_directory(["-O3"]) != here
    assert (here / f"{cpu_kernels.NAME}_{cpu_kernels.current()}.so").is_file()


def _as_if_not_yet_built() -> None:
    """Take back the mark a finished build leaves, so the next load goes through the build step
    (its lock and the build tool) as it does before the first build completes."""
    (cpu_kernels.build_directory() / cpu_kernels.BUILT_MARKER).unlink(missing_ok=True)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(built):
    directory = cpu_kernels.build_directory()
    _as_if_not_yet_built()
    with cpu_kernels.build_lock(directory, wait_s=120):  # as a killed builder leaves it: torch's lock file
        (directory / "lock").write_text("")
    assert (directory / "lock").exists()
    assert _load_in_a_new_process() == "loaded"  # before the fix: torch's FileBaton waited forever
    assert not (directory / "lock").exists()


def test_a_build_held_too_long_by_another_process_gives_up_in_one_line(built):
    _as_if_not_yet_built()
    with cpu_kernels.build_lock(cpu_kernels.build_directory(), wait_s=120):
        said = _load_in_a_new_process(**{cpu_kernels.WAIT_ENV: "1"})
    assert said.startswith("not loaded: another process has been building the CPU kernels in")
    assert cpu_kernels.WAIT_ENV in said and "\n" not in said


def test_every_capability_the_cpu_has_is_built():
    """The capabilities the kernels are built for are those /proc/cpuinfo says this CPU has, and
    the process runs the best of them: a CPU feature the build step missed fails here."""
    assert set(CPU_CAPABILITY_FLAGS) == set(cpu_kernels.CAPABILITIES)
    have = tuple(c for c in cpu_kernels.CAPABILITIES if CPU_CAPABILITY_FLAGS[c] <= cpu_flags())
    assert cpu_kernels.machine_capabilities() == have
    if have:
        assert cpu_kernels.current() == have[-1]


@pytest.mark.parametrize("capability", [c for c in CPU_CAPABILITY_FLAGS if CPU_CAPABILITY_FLAGS[c] <= cpu_flags()])
def test_capabilities_load_side_by_side_each_in_its_namespace(capability):
    """Each capability's build registers its operators in a namespace of its own, so a process runs
    either (KVLEDGER_CPU_CAPABILITY picks the first) and switches to the other inside :func:`use`."""
    width = {"avx2": 8, "avx512": 16}[capability]
    said = _load_in_a_new_process(**{cpu_kernels.CAPABILITY_ENV: capability})
    assert said == "loaded"
    with cpu_kernels.use(capability) as build:
        assert build.loaded and cpu_kernels.vector_width() == width
        assert cpu_kernels.ops() is getattr(torch.ops, f"kvledger_cpu_{capability}")
        assert cpu_kernels.ops().panel_width() == 2 * width


def test_no_vector_capability_falls_back_and_says_so_once():
    """With no capability (a CPU without AVX2, or KVLEDGER_CPU_CAPABILITY=default) nothing is built:
    the process reports the kernels not loaded, and its log says why in one line, once, however
    often the engine asks."""
    code = (LOAD + "; c.loaded(); c.vector_width(); c.reason(); "
            "from kvledger.kernels import paged_decode; import torch; "
            "print(paged_decode.supports(torch.device('cpu'), torch.float32, 9, 3, 64))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, cpu_kernels.CAPABILITY_ENV: "default"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["not", "loaded:", f"{cpu_kernels.CAPABILITY_ENV}=default", "False"]
    warnings = [line for line in proc.stderr.splitlines() if "kernels" in line]
    assert len(warnings) == 1 and "torch's own kernels run instead" in warnings[0], proc.stderr


def test_built_kernels_load_without_running_the_build_tool(built, tmp_path):
    """Once built, a process loads the library as it is: another ``ninja`` first on ``PATH`` (an
    activated venv against none) is never run, so it cannot find the build out of date."""
    calls = tmp_path / "calls"
    ninja = tmp_path / "ninja"
    ninja.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    ninja.chmod(0o755)
    proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "loaded"
    assert not calls.exists(), f"the build tool ran: {calls.read_text()}"
    assert "building" not in proc.stderr
