"""The server's engine thread: one thread, the same for every call, its errors raised to the caller."""

from __future__ import annotations

import sys
import threading

import pytest

from kvledger.server.engine_thread import GIL_SWITCH_INTERVAL_S, engine_thread, on_engine_thread


def test_every_call_runs_on_one_thread_that_is_not_the_callers() -> None:
    idents = {on_engine_thread(threading.get_ident) for _ in range(5)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert on_engine_thread(lambda: threading.current_thread().name).startswith("kvledger-engine")
    assert engine_thread() is engine_thread()


def test_results_and_errors_come_back_to_the_caller() -> None:
    assert on_engine_thread(sum, [1, 2, 3]) == 6
    assert on_engine_thread(dict, a=1) == {"a": 1}
    with pytest.raises(ValueError, match="invalid literal"):
        on_engine_thread(int, "not a number")


def test_starting_the_engine_thread_shortens_the_gil_switch_interval() -> None:
    """The engine thread takes the GIL back after every operator; with Python's 5 ms default it
    could wait that long behind the event loop's handlers (kvledger serve, fleet replicas)."""
    engine_thread()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S) and GIL_SWITCH_INTERVAL_S < 0.005
