"""The server's engine thread: one thread, the same for every call, its errors raised to the caller."""

from __future__ import annotations

import threading

import pytest

from kvledger.server.engine_thread import engine_thread, on_engine_thread


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
