"""Run the real ``kvledger`` CLI in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def kvledger(*args: str, timeout: float = 300) -> Result:
    proc = subprocess.run([sys.executable, "-m", "kvledger.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_error(result: Result, *needles: str) -> None:
    """Exit 2, one line on stderr, no traceback, and the line names the problem."""
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def assert_runs_without_torch(argv: list[str]) -> None:
    """``kvledger ARGV`` in a fresh interpreter exits 0 without importing torch (the spec, planner
    and simulator are pure Python)."""
    code = ("import sys; from kvledger.cli.main import main; import kvledger.spec, kvledger; "
            f"rc = main({argv!r}); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch was imported'; print('clean')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("clean")


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """End a ``kvledger serve`` process: SIGTERM, then SIGKILL if it has not exited in ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
