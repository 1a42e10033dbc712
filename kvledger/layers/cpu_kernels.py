"""kvledger's own CPU kernels (``csrc/``), built once per machine on first use, as ``torch.ops.kvledger_cpu``.

Six kernels, each where torch's general ones leave this CPU idle:

* ``paged_decode`` (``csrc/paged_decode.cpp``): decode attention reading K/V where they lie in
  the paged cache (:mod:`kvledger.layers.paged_decode`);
* ``paged_prefill`` (``csrc/paged_prefill.cpp``): causal attention of a prefill chunk reading
  K/V where they lie in the paged cache (:mod:`kvledger.layers.paged_prefill`);
* ``rms_norm`` (``csrc/rms_norm.cpp``): RMSNorm in one call (:mod:`kvledger.layers.rmsnorm`);
* ``rotary`` (``csrc/rotary.cpp``) and ``silu_and_mul`` (``csrc/silu_and_mul.cpp``): RoPE and
  SwiGLU's gate in one call each, equal to the torch operators they replace
  (:mod:`kvledger.layers.rotary`, :mod:`kvledger.layers.activation`);
* ``panel_linear`` (``csrc/panel_linear.cpp``): a projection of one to a few dozen rows (the
  decode steps) on a weight laid out in column panels (``pack_panels``), streaming it at memory
  speed with few rows and keeping the FMA units busy with more (:mod:`kvledger.layers.linear`).

They are compiled with the C++ compiler that ``torch.compile`` needs too
(``torch.utils.cpp_extension``), for the vector instructions inductor picks for this CPU, in
about a minute on two cores. The build lives in a directory of torch's extension root keyed by
a hash of the sources, the flags and the torch and Python versions (:func:`build_directory`), so
two checkouts with the same sources share one build and different sources never rebuild over
each other. Builders take an advisory lock on that directory (``flock``, which the system
releases when a process dies), so a build killed halfway never leaves behind a lock that makes
every later load wait forever (torch's own lock file is cleared while the lock is held). A
process that waits longer than ``KVLEDGER_CPU_KERNELS_WAIT_S`` (default 900 s) for another
one's build gives up. Where they cannot be built (no compiler, the wait given up), or with
``KVLEDGER_CPU_KERNELS=0``, the engine runs torch's own operators (SDPA over fresh or gathered
K/V, the composite norm, RoPE and gate, oneDNN's or MKL's products) and says why once in its log.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

CPU_KERNELS_ENV = "KVLEDGER_CPU_KERNELS"
WAIT_ENV = "KVLEDGER_CPU_KERNELS_WAIT_S"
DEFAULT_WAIT_S = 900.0
"""Seconds a process waits for another one's build of the same kernels before it gives up."""
NAME = "kvledger_cpu_kernels"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the kernels compute in."""
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_decode.cpp", "paged_prefill.cpp", "rms_norm.cpp", "rotary.cpp", "silu_and_mul.cpp",
                                                                "panel_linear.cpp")]

log = logging.getLogger("kvledger.engine")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "width": floats per vector, "reason": str


def _flags() -> tuple[list[str], int]:
    """The compiler flags for this CPU and the floats per vector they give."""
    flags = ["-O3", "-fopenmp"]
    width = 8  # floats per vector without a vector ISA (ATen's default: 32 bytes)
    try:  # the vector ISA inductor would use on this CPU, and ATen's macro for it
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
        if isa:
            flags += [f"-D{m}" for m in isa.build_macro()] + isa.build_arch_flags().split()
            width = isa.nelements(torch.float32)
    except Exception as err:  # noqa: BLE001 - a private API: plain C++ still works
        log.info("no vector ISA for the CPU kernels (%s); building them without one", err)
    return flags, width


def build_directory(flags: list[str] | None = None) -> Path:
    """Where the kernels for these sources and flags are built: ``<torch extension root>/
    kvledger_cpu_kernels/<hash>``, the root being ``TORCH_EXTENSIONS_DIR`` or torch's default."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for source in sorted(SOURCES + list(SOURCES[0].parent.glob("*.h"))):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    key = [*(flags if flags is not None else _flags()[0]), torch.__version__, sys.version.split()[0]]
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


def _build() -> None:
    from torch.utils import cpp_extension

    flags, width = _flags()
    directory = build_directory(flags)
    wait_s = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    started = time.perf_counter()
    with build_lock(directory, wait_s):
        cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=flags, build_directory=str(directory),
                           is_python_module=False, verbose=False)
    log.info("kvledger CPU kernels ready in %.1f s", time.perf_counter() - started)
    _state["width"] = width


def loaded() -> bool:
    """True once the kernels are built and loaded (built on the first call); False, with the
    reason logged once, when they are turned off or cannot be built."""
    if "loaded" not in _state:
        with _lock:
            if "loaded" not in _state:
                if os.environ.get(CPU_KERNELS_ENV, "1") == "0":
                    _state["reason"] = f"{CPU_KERNELS_ENV}=0"
                    _state["loaded"] = False
                else:
                    try:
                        _build()
                        _state["loaded"] = True
                    except Exception as err:  # noqa: BLE001 - no compiler, no ninja: torch's kernels instead
                        text = str(err).strip()
                        _state["reason"] = text.splitlines()[-1] if text else type(err).__name__
                        _state["loaded"] = False
                if not _state["loaded"]:
                    log.warning("kvledger CPU kernels not used (%s); torch's own kernels run instead", _state["reason"])
    return bool(_state["loaded"])


def vector_width() -> int:
    """Floats per vector register the kernels were built for (16 with AVX-512); 0 when not loaded."""
    return int(_state["width"]) if loaded() else 0  # type: ignore[call-overload]


def reason() -> str | None:
    """Why the kernels are not loaded, or None."""
    return None if loaded() else str(_state.get("reason"))


def attention_operands(q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` with its last dimension contiguous and the output ``[..., d]`` the attention kernels
    write (``out``, or a new tensor like ``q``), the kernels loaded (a tensor-parallel rank may
    reach a kernel without having asked whether it is supported)."""
    loaded()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return (q if q.stride(-1) == 1 else q.contiguous()), out
