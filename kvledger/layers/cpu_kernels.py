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
* ``skinny_linear`` (``csrc/skinny_linear.cpp``): a projection of at most four rows (a decode
  step of a few sequences) streaming its weight at memory speed (:mod:`kvledger.layers.linear`).

They are compiled with the C++ compiler that ``torch.compile`` needs too
(``torch.utils.cpp_extension``), for the vector instructions inductor picks for this CPU, in
about 20 s; torch caches the build on disk, keyed by the sources and flags. Where they cannot
be built (no compiler), or with ``KVLEDGER_CPU_KERNELS=0``, the engine runs torch's own
operators (SDPA over fresh or gathered K/V, the composite norm, RoPE and gate, oneDNN's or MKL's products) and says why once in its log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

CPU_KERNELS_ENV = "KVLEDGER_CPU_KERNELS"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the kernels compute in."""
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_decode.cpp", "paged_prefill.cpp", "rms_norm.cpp", "rotary.cpp", "silu_and_mul.cpp",
                                                                "skinny_linear.cpp")]

log = logging.getLogger("kvledger.engine")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "width": floats per vector, "reason": str


def _build() -> None:
    from torch.utils import cpp_extension

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
    started = time.perf_counter()
    cpp_extension.load(name="kvledger_cpu_kernels", sources=[str(s) for s in SOURCES], extra_cflags=flags,
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
