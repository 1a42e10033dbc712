"""The CPU kernels' build step: a build killed halfway never makes a later load wait forever,
and a process that waits too long for another one's build says so in one line and falls back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvledger.layers import cpu_kernels

LOAD = ("from kvledger.layers import cpu_kernels as c; ok = c.loaded(); "
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
    assert (here / f"{cpu_kernels.NAME}.so").is_file()


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(built):
    directory = cpu_kernels.build_directory()
    with cpu_kernels.build_lock(directory, wait_s=120):  # as a killed builder leaves it: torch's lock file
        (directory / "lock").write_text("")
    assert (directory / "lock").exists()
    assert _load_in_a_new_process() == "loaded"  # before the fix: torch's FileBaton waited forever
    assert not (directory / "lock").exists()


def test_a_build_held_too_long_by_another_process_gives_up_in_one_line(built):
    with cpu_kernels.build_lock(cpu_kernels.build_directory(), wait_s=120):
        said = _load_in_a_new_process(**{cpu_kernels.WAIT_ENV: "1"})
    assert said.startswith("not loaded: another process has been building the CPU kernels in")
    assert cpu_kernels.WAIT_ENV in said and "\n" not in said
