"""What a test process gives back once it is done with its models."""

from __future__ import annotations

import ctypes
import gc


def release_freed_memory() -> None:
    """Collect garbage, then give the C heap's free pages back to the system (glibc's
    ``malloc_trim``; elsewhere the collection only). A freed engine's 1-2 GB otherwise stay in the
    process's heap: the next file's models are allocated beside them, and Ray's memory monitor,
    which kills actors once the machine is 95% full, counts them."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
