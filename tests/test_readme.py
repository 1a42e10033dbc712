"""The README's command blocks, run: what the README shows is what the commands print.

A fenced block of README.md whose first line starts with ``$ kvledger`` is a transcript. Each
``$`` line (continued on the next while it ends with a backslash) is a command, run as a user
runs it: through a shell, from the repository's root, ``kvledger`` being this checkout's CLI, on
the CPU (the README's engine examples are CPU runs). The lines below it, up to the next ``$`` or
the end of the block, are its standard output. A line ``...`` stands for any number of lines
the README leaves out. A server (``serve``) is stopped, as with Ctrl-C, once it has printed the
lines the README shows.

Lines are compared exactly (trailing spaces aside), except the lines ``MACHINE_DEPENDENT`` names:
there numbers may differ (a wall time, a float difference that depends on the CPU's arithmetic)
and nothing else may. Every expected line is read from README.md; none is written here. A block
whose subcommand is neither in ``CHEAP`` nor in ``EXPENSIVE`` fails, so that a new README example
is run, or this file says why not.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GAP = "..."
"""A line of its own in a transcript: any number of output lines the README leaves out."""

CHEAP = frozenset({"kv-bytes", "plan", "advise", "gpus", "verify"})
"""Subcommands whose README examples finish in a second or two: the planner, and verify at small sizes."""
EXPENSIVE = frozenset({"generate", "serve", "simulate"})
"""Subcommands whose examples load the model or replay thousands of requests: marked slow."""
SERVERS = frozenset({"serve"})
"""Subcommands that run until stopped."""

MACHINE_DEPENDENT: dict[str, tuple[str, ...]] = {
    "verify": (r"^max \|full - cached\|",),  # float32 rounding: the CPU's vector width, BLAS, threads
    "simulate": (r" simulated in ",),  # the replay's wall time
}
"""Per subcommand, patterns of the output lines whose numbers may differ from the README's."""

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
CHEAP_TIMEOUT_S = 120
EXPENSIVE_TIMEOUT_S = 600


@dataclass(frozen=True)
class Transcript:
    """One command of a README block and the output the README shows for it."""

    line: int  # README.md's line of the ``$``, counted from 1
    command: str  # as a shell reads it, continuation lines included
    expected: tuple[str, ...]

    @property
    def subcommand(self) -> str:
        """``kv-bytes`` of ``kvledger kv-bytes llama-3.1-8b ...``."""
        words = shlex.split(self.command.replace("\\\n", " "))
        assert words[0] == "kvledger", f"README.md:{self.line}: a transcript runs kvledger, not {words[0]!r}"
        return words[1]

    @property
    def port(self) -> int | None:
        """The ``--port`` a server command names, if any."""
        words = shlex.split(self.command.replace("\\\n", " "))
        return int(words[words.index("--port") + 1]) if "--port" in words else None


def transcripts(text: str) -> list[Transcript]:
    """Every command of every fenced block of ``text`` that starts with ``$ kvledger``."""
    found: list[Transcript] = []
    block: list[str] | None = None
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if block is None:
                block, start = [], number + 1
            else:
                if block and block[0].startswith("$ kvledger"):
                    found += _block_transcripts(block, start)
                block = None
        elif block is not None:
            block.append(line)
    return found


def _block_transcripts(block: list[str], first_line: int) -> list[Transcript]:
    """The commands of one block (its first line is a ``$`` line) with the output lines below each."""
    found: list[Transcript] = []
    i = 0
    while i < len(block):
        line, start = block[i], first_line + i
        command = [line[2:]]
        while command[-1].endswith("\\") and i + 1 < len(block):
            i += 1
            command.append(block[i])
        i += 1
        expected = []
        while i < len(block) and not block[i].startswith("$ "):
            expected.append(block[i])
            i += 1
        found.append(Transcript(start, "\n".join(command), tuple(_trimmed(expected))))
    return found


def _trimmed(lines: list[str]) -> list[str]:
    """Lines without trailing spaces, and without the blank lines at the end."""
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def same_line(variable: list[re.Pattern[str]]) -> Callable[[str, str], bool]:
    """Equality of an expected and an actual line: exact, or with numbers free where the
    expected line matches one of ``variable``."""

    def same(want: str, got: str) -> bool:
        if want == got:
            return True
        return any(p.search(want) for p in variable) and NUMBER.sub("#", want) == NUMBER.sub("#", got)

    return same


def fits(expected: list[str], actual: list[str], same: Callable[[str, str], bool]) -> bool:
    """Whether ``actual`` is ``expected`` with each ``...`` line standing for any run of lines:
    the part before the first gap starts the output, the part after the last ends it, and the
    parts between come in order."""
    parts: list[list[str]] = [[]]
    for line in expected:
        if line.strip() == GAP:
            parts.append([])
        else:
            parts[-1].append(line)

    def at(part: list[str], i: int) -> bool:
        return 0 <= i and i + len(part) <= len(actual) and all(same(w, actual[i + k]) for k, w in enumerate(part))

    if len(parts) == 1:
        return len(actual) == len(expected) and at(expected, 0)
    head, *middle, tail = parts
    if not at(head, 0):
        return False
    pos = len(head)
    for part in middle:
        found = next((i for i in range(pos, len(actual) - len(part) + 1) if at(part, i)), None)
        if found is None:
            return False
        pos = found + len(part)
    return len(actual) - len(tail) >= pos and at(tail, len(actual) - len(tail))


def shell_script(command: str) -> list[str]:
    """``bash -c`` running ``command`` with ``kvledger`` as this checkout's CLI (this interpreter,
    the repository's root first on its path)."""
    prelude = 'set -o pipefail\nkvledger() { exec "$CLI_PYTHON" -m kvledger.cli.main "$@"; }\n'
    return ["bash", "-c", prelude + command]


def environment() -> dict[str, str]:
    """The test's environment, with the CLI's interpreter named and no GPU visible (the README's
    engine examples are CPU runs: block size 128)."""
    return dict(os.environ, CLI_PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")


def run_command(command: str, timeout: float) -> tuple[list[str], str]:
    """Standard output (as lines) and standard error of ``command`` run to its end."""
    proc = subprocess.run(shell_script(command), cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=timeout)
    return _trimmed(proc.stdout.splitlines()), f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"


def run_server(command: str, lines: int, timeout: float) -> tuple[list[str], str]:
    """The first ``lines`` lines a server command prints (fewer if it exits first), then Ctrl-C."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(shell_script(command), cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                                stderr=err, text=True)
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        out: list[str] = []
        try:
            assert proc.stdout is not None
            while len(out) < lines:
                line = proc.stdout.readline()
                if not line:
                    break
                out.append(line.rstrip("\n"))
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        return _trimmed(out), f"exit {proc.returncode}; stderr:\n{err.read()[-3000:]}"


def port_taken(port: int) -> bool:
    """Whether a server could not bind ``port`` on loopback now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


TRANSCRIPTS = transcripts(README.read_text())


def test_the_readme_has_transcripts_and_each_is_run():
    assert TRANSCRIPTS, "no '$ kvledger' block found in README.md: has its format changed?"
    unknown = {t.subcommand for t in TRANSCRIPTS} - CHEAP - EXPENSIVE
    assert not unknown, f"README.md shows {sorted(unknown)}: add them to CHEAP or EXPENSIVE in {__file__}"


def _param(t: Transcript):
    marks = [pytest.mark.slow] if t.subcommand in EXPENSIVE else []
    return pytest.param(t, id=f"README.md:{t.line}:{t.subcommand}", marks=marks)


@pytest.mark.parametrize("transcript", [_param(t) for t in TRANSCRIPTS])
def test_readme_transcript(transcript: Transcript):
    timeout = EXPENSIVE_TIMEOUT_S if transcript.subcommand in EXPENSIVE else CHEAP_TIMEOUT_S
    if transcript.subcommand in SERVERS:
        port = transcript.port
        if port and port_taken(port):
            pytest.skip(f"README.md:{transcript.line} serves on port {port}, which another program holds")
        assert GAP not in transcript.expected, "a server's transcript shows its first lines, with no gap"
        actual, diagnostics = run_server(transcript.command, len(transcript.expected), timeout)
    else:
        actual, diagnostics = run_command(transcript.command, timeout)
    variable = [re.compile(p) for p in MACHINE_DEPENDENT.get(transcript.subcommand, ())]
    expected = list(transcript.expected)
    if not fits(expected, actual, same_line(variable)):
        diff = "\n".join(difflib.unified_diff(expected, actual, "README.md", "output", lineterm=""))
        pytest.fail(f"README.md:{transcript.line}: `{transcript.command}` prints otherwise than the README "
                    f"shows:\n{diff}\n({diagnostics})", pytrace=False)
