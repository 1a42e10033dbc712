"""``kvledger serve --data-parallel-size 2`` as a user runs it in a terminal: it prints its start
line, serves, and a Ctrl-C (SIGINT to the terminal's whole process group, Ray's processes with it)
ends it with one stop line on stdout, exit 0, no traceback, no colour codes, and no process of the
run left behind. ``make test`` runs this file after the others, alone (two more replicas)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray")

ANSI_ESCAPE = re.compile(r"\x1b\[")
STARTED_S, STOPPED_S = 300, 120
"""Seconds allowed for the fleet to start (Ray, two replicas loading the model) and to stop."""


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line the process prints on stdout, or a failure with its stderr."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no start line in {timeout} s")
    if not line:
        pytest.fail(f"serve ended before it started: {proc.communicate(timeout=60)[1][-2000:]}")
    return line


def _left_in_session(session: int) -> list[str]:
    """The processes still in the run's session (the CLI started its own: ``start_new_session``)."""
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getsid(p.info["pid"]) == session:
                left.append(f"{p.info['pid']} {p.info['name']}")
        except (ProcessLookupError, PermissionError):
            continue
    return left


@pytest.mark.slow
def test_a_fleet_from_the_cli_stops_cleanly_on_ctrl_c():
    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli.main", "serve", "smollm2-135m", "--data-parallel-size", "2",
         "--port", "0", "--dtype", "float32", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
         "--block-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    started = _first_line(proc, STARTED_S)
    url = re.search(r" on (http://\S+) ", started).group(1)
    reply = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "The capital of France is",
                                                      "max_tokens": 3, "temperature": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3

    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches its whole foreground group
    out, err = proc.communicate(timeout=STOPPED_S)
    assert proc.returncode == 0, err[-2000:]
    assert started.startswith("kvledger serve: 2 replicas of smollm2-135m on http://")
    assert out.splitlines() == ["kvledger serve: stopped"], out
    assert not ANSI_ESCAPE.search(started + out), "colour codes on stdout"
    assert "Traceback" not in err, err[-2000:]
    deadline = time.monotonic() + 30
    while (left := _left_in_session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of the run still alive: {left}"
