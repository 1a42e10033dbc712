"""kvledger's own CPU kernels (``csrc/``), built once per machine on first use, as ``torch.ops.kvledger_cpu``.

Six kernels, each where torch's general ones leave this CPU idle:

* ``paged_decode`` (``csrc/paged_decode.cpp``): decode attention reading K/V where they lie in
  the paged cache (:mod:`kvledger.kernels.paged_decode`);
* ``paged_prefill`` (``csrc/paged_prefill.cpp``): causal attention of a prefill chunk reading
  K/V where they lie in the paged cache (:mod:`kvledger.kernels.paged_prefill`);
* ``rms_norm`` (``csrc/rms_norm.cpp``): RMSNorm in one call (:mod:`kvledger.layers.rmsnorm`);
* ``rotary`` (``csrc/rotary.cpp``) and ``silu_and_mul`` (``csrc/silu_and_mul.cpp``): RoPE and
  SwiGLU's gate in one call each, equal to the torch operators they replace
  (:mod:`kvledger.layers.rotary`, :mod:`kvledger.layers.activation`);
* ``panel_linear`` (``csrc/panel_linear.cpp``): a projection of one to a few dozen rows (the
  decode steps) on a weight laid out in column panels (``pack_panels``), streaming it at memory
  speed with few rows and keeping the FMA units busy with more (:mod:`kvledger.layers.linear`).

They are compiled with the C++ compiler that ``torch.compile`` needs too
(``torch.utils.cpp_extension``), in about a minute on two cores, once per *capability*: the vector
instructions they are built for, ``avx2`` (8 floats a vector) or ``avx512`` (16; with AVX-512's
BF16 conversions where the CPU has them). The process runs the best capability the CPU has (as
torch's cpuinfo reads it), or the one ``KVLEDGER_CPU_CAPABILITY`` names (``avx2`` on an AVX-512 machine runs the
code an AVX2-only one runs, as ``ATEN_CPU_CAPABILITY`` does for ATen's kernels); :func:`use`
switches it, and the tests run every kernel under every capability the machine has
(:func:`machine_capabilities`). Each build registers its operators in its own namespace
(``torch.ops.kvledger_cpu_avx2``, ``torch.ops.kvledger_cpu_avx512``; :func:`ops` is the current
one), so both load side by side. A CPU without AVX2 builds nothing and runs torch's operators.

``make`` builds them at install (``python -m kvledger.kernels.cpu_kernels``); otherwise the first
use builds them and says so on stderr. A build lives in a directory of torch's extension root keyed
by a hash of the sources, the flags and the torch and Python versions (:func:`build_directory`), so
two checkouts with the same sources share one build and different sources never rebuild over each
other (the build compiles copies of the sources kept in that directory, so its build file is the
same from every checkout); once built, a process loads the library directly, without running the
build tool (whichever ``ninja`` ``PATH`` finds), and a build pins the one beside the running Python. Builders take an advisory
lock on that directory (``flock``, which the system releases when a process dies), so a build
killed halfway never leaves behind a lock that makes every later load wait forever (torch's own
lock file is cleared while the lock is held). A process that waits longer than
``KVLEDGER_CPU_KERNELS_WAIT_S`` (default 900 s) for another one's build gives up. Where they cannot
be built (no compiler, no AVX2, the wait given up), or with ``KVLEDGER_CPU_KERNELS=0``, the engine
runs torch's own operators (SDPA over fresh or gathered K/V, the composite norm, RoPE and gate,
oneDNN's or MKL's products) and says why once in its log.
"""

from __future__ import annotations

import contextlib
import functools
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CPU_KERNELS_ENV = "KVLEDGER_CPU_KERNELS"
CAPABILITY_ENV = "KVLEDGER_CPU_CAPABILITY"
WAIT_ENV = "KVLEDGER_CPU_KERNELS_WAIT_S"
DEFAULT_WAIT_S = 900.0
"""Seconds a process waits for another one's build of the same kernels before it gives up."""
NAME = "kvledger_cpu_kernels"
CAPABILITIES = ("avx2", "avx512")
"""The vector capabilities the kernels are built for, lowest first."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the kernels compute in."""
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("ops.cpp", "paged_decode.cpp", "paged_prefill.cpp", "rms_norm.cpp", "rotary.cpp",
                                    "silu_and_mul.cpp", "panel_linear.cpp")]

log = logging.getLogger("kvledger.engine")


@dataclass
class Build:
    """One capability's kernels: loaded or why not, the floats per vector, their operators."""

    capability: str
    loaded: bool = False
    width: int = 0
    reason: str | None = None
    ops: Any = None


_lock = threading.Lock()
_builds: dict[str, Build] = {}
_stack: list[Build] = []  # the build the process runs (last), chosen on first use; use() pushes


ARCH_FLAGS = {
    "avx2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
}
"""Each capability's macro (ATen's vector types follow it) and instruction flags, as inductor
builds its own kernels for them; AVX-512 adds BF16's conversions where the CPU has them."""
FLOATS_PER_VECTOR = {"avx2": 8, "avx512": 16}


def _cpu_has(capability: str) -> bool:
    """Whether this CPU (and its OS) runs ``capability``, as torch's cpuinfo reads it in-process
    (inductor's own check compiles and loads a probe in a subprocess: seconds per process)."""
    return bool(torch.cpu._is_avx2_supported() if capability == "avx2" else torch.cpu._is_avx512_supported())


@functools.cache
def machine_capabilities() -> tuple[str, ...]:
    """The capabilities this CPU can run, lowest first: ``()`` without AVX2."""
    return tuple(c for c in CAPABILITIES if _cpu_has(c))


def namespace(capability: str) -> str:
    """The operator namespace of ``capability``'s build (``kvledger_cpu_avx2``)."""
    return f"kvledger_cpu_{capability}"


def _flags(capability: str) -> tuple[list[str], int]:
    """The compiler flags for ``capability`` on this CPU and the floats per vector they give."""
    flags = ["-O3", "-fopenmp", f"-DKVLEDGER_OPS={namespace(capability)}", *ARCH_FLAGS[capability]]
    if capability == "avx512" and torch.cpu._is_avx512_bf16_supported():
        flags.append("-mavx512bf16")
    return flags, FLOATS_PER_VECTOR[capability]


def build_directory(flags: list[str] | None = None) -> Path:
    """Where the kernels for these sources and flags (the current capability's by default) are built: ``<torch extension root>/kvledger_cpu_kernels/<hash>``, the root being
    ``TORCH_EXTENSIONS_DIR`` or torch's default."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for source in sorted(SOURCES + list(CSRC.glob("*.h"))):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    if flags is None:
        flags = _flags(current())[0]
    key = [*flags, torch.__version__, sys.version.split()[0]]
    digest.update("\0".join(key).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / NAME / digest.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(directory: Path, wait_s: float) -> Iterator[None]:
    """Holds the advisory lock on ``directory`` (waiting up to ``wait_s`` seconds for another
    process's build), with torch's own lock file cleared: whoever left one holds no lock now, so
    it was killed mid-build. Raises TimeoutError after the wait."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvledger.lock", "w") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building the CPU kernels in {directory} for over "
                                       f"{wait_s:.0f} s; let it finish or raise {WAIT_ENV}") from None
                time.sleep(0.2)
        try:
            (directory / "lock").unlink(missing_ok=True)  # torch's FileBaton, left by a killed build
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


BUILT_MARKER = "kvledger.built"
"""Written into a build directory once its library is built; a later process loads that library
directly, without running the build tool again (a different ``ninja`` on ``PATH``, as with and
without an activated venv, would otherwise see the other's log as out of date and rebuild all)."""


def _build(build: Build) -> None:
    """Load ``build``'s library: the one already built for these sources and flags, else build it
    first (announced on stderr: a minute or so, once per machine)."""
    flags, width = _flags(build.capability)
    directory = build_directory(flags)
    name = f"{NAME}_{build.capability}"
    started = time.perf_counter()
    if not _load_built(directory, name):
        wait_s = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
        with build_lock(directory, wait_s):
            if not _load_built(directory, name):  # another process may have built it while we waited
                print(f"kvledger: building the CPU kernels for {build.capability.upper()} once (about a minute on "
                      f"two cores; later starts load them)", file=sys.stderr, flush=True)
                _compile(name, flags, directory)
                (directory / BUILT_MARKER).write_text(f"{name}.so\n")
    log.info("kvledger CPU kernels (%s) ready in %.1f s", build.capability, time.perf_counter() - started)
    build.width = width
    build.ops = getattr(torch.ops, namespace(build.capability))


def _load_built(directory: Path, name: str) -> bool:
    """Load the library a finished build left in ``directory``; False when there is none."""
    library = directory / f"{name}.so"
    if not ((directory / BUILT_MARKER).is_file() and library.is_file()):
        return False
    torch.ops.load_library(str(library))
    return True


def _copy_sources(destination: Path) -> list[Path]:
    """The sources and headers copied into the build directory (once: the directory is keyed by
    their content), so that its build file names the same paths whichever checkout builds it;
    the copies of :data:`SOURCES`, in order."""
    destination.mkdir(parents=True, exist_ok=True)
    for source in SOURCES + sorted(CSRC.glob("*.h")):
        copy = destination / source.name
        if not copy.is_file():
            tmp = copy.with_suffix(copy.suffix + ".tmp")
            tmp.write_bytes(source.read_bytes())
            tmp.replace(copy)
    return [destination / source.name for source in SOURCES]


def _compile(name: str, flags: list[str], directory: Path) -> None:
    """Compile and load the sources with torch's extension builder, the build tool pinned to the one
    beside this Python (the venv's ``ninja``) when there is one, whatever ``PATH`` says."""
    from torch.utils import cpp_extension

    sources = _copy_sources(directory / "src")
    saved = os.environ.get("PATH", "")
    here = str(Path(sys.executable).parent)
    if (Path(here) / "ninja").exists():
        os.environ["PATH"] = here + os.pathsep + saved
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=flags,
                           build_directory=str(directory), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = saved


def _load(capability: str) -> Build:
    """``capability``'s build, built and loaded on the first call, or with the reason it is not."""
    build = _builds.get(capability)
    if build is not None:
        return build
    with _lock:
        if capability in _builds:
            return _builds[capability]
        build = Build(capability)
        if os.environ.get(CPU_KERNELS_ENV, "1") == "0":
            build.reason = f"{CPU_KERNELS_ENV}=0"
        elif capability == "default":  # ATen's name for no vector instructions
            build.reason = f"{CAPABILITY_ENV}=default"
        elif capability not in CAPABILITIES:
            build.reason = f"{CAPABILITY_ENV}={capability} is not one of {', '.join(CAPABILITIES)} or default"
        elif capability not in machine_capabilities():
            have = ", ".join(machine_capabilities())
            build.reason = (f"this CPU has no {capability.upper()}" + (f" (it has {have}: set {CAPABILITY_ENV} to one)"
                                                                        if have else ""))
        else:
            try:
                _build(build)
                build.loaded = True
            except Exception as err:  # noqa: BLE001 - no compiler, no ninja: torch's kernels instead
                text = str(err).strip()
                build.reason = text.splitlines()[-1] if text else type(err).__name__
        if not build.loaded:
            log.warning("kvledger CPU kernels (%s) not used (%s); torch's own kernels run instead", capability, build.reason)
        _builds[capability] = build
        return build


def _active() -> Build:
    """The build the process runs now (:func:`current`'s), loaded on the first call."""
    if not _stack:
        have = machine_capabilities()
        aten = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
        aten = aten if aten in (*CAPABILITIES, "default") else ""
        build = _load(os.environ.get(CAPABILITY_ENV) or aten or (have[-1] if have else "avx2"))
        with _lock:
            if not _stack:
                _stack.append(build)
    return _stack[-1]


def current() -> str:
    """The capability this process runs: :func:`use`'s, else ``KVLEDGER_CPU_CAPABILITY`` (``default``:
    none, torch's own operators), else ``ATEN_CPU_CAPABILITY`` where it names one (torch's own
    kernels then run the same instructions), else the best the CPU has (``avx2`` names it where the CPU has
    none: it is then not loaded, and the log says this CPU has no AVX2)."""
    return _active().capability


@contextlib.contextmanager
def use(capability: str) -> Iterator[Build]:
    """Runs the kernels built for ``capability`` inside the block (built on entry), then the
    previous ones. For tests and benchmarks: a model whose weights were packed for one width
    (``pack_panels``) must not be run under the other."""
    _active()
    build = _load(capability)
    _stack.append(build)
    try:
        yield build
    finally:
        _stack.pop()


def loaded() -> bool:
    """True once the current capability's kernels are built and loaded (built on the first
    call); False, with the reason logged once, when they are turned off or cannot be built."""
    return (_stack[-1] if _stack else _active()).loaded


def ops() -> Any:
    """The current capability's operators (``torch.ops.kvledger_cpu_<capability>``), loaded. On
    every kernel call of a step: a list's last item once the process has chosen."""
    build = _stack[-1] if _stack else _active()
    if build.ops is None:
        raise RuntimeError(f"kvledger CPU kernels not loaded: {build.reason}")
    return build.ops


def vector_width() -> int:
    """Floats per vector register the current kernels were built for (16 with AVX-512); 0 when not loaded."""
    build = _active()
    return build.width if build.loaded else 0


def reason() -> str | None:
    """Why the current kernels are not loaded, or None."""
    build = _active()
    return None if build.loaded else build.reason


def attention_operands(q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` with its last dimension contiguous and the output ``[..., d]`` the attention kernels
    write (``out``, or a new tensor like ``q``), the kernels loaded (a tensor-parallel rank may
    reach a kernel without having asked whether it is supported)."""
    loaded()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return (q if q.stride(-1) == 1 else q.contiguous()), out


def runs_eagerly_on(x: torch.Tensor) -> bool:
    """True when a kernel may take ``x`` now: a CPU tensor of a kernel dtype, outside a graph that
    ``torch.compile`` traces (where torch's operators run and inductor fuses them), with the
    kernels loaded. Each wrapper adds the shape conditions of its own kernel."""
    return (x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and not torch.compiler.is_compiling()
            and loaded())


def main() -> None:
    """``python -m kvledger.kernels.cpu_kernels``: build (or load) the kernels of every capability this
    CPU has, ahead of the first use; ``make`` runs it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for capability in machine_capabilities():
        with use(capability) as build:
            print(f"kvledger CPU kernels ({capability}): {'ready' if build.loaded else build.reason}")


if __name__ == "__main__":
    main()
