"""gradserve.engine.collector.paused: the garbage collector off while a compile or a parse runs, and
back as it was after, however the work ends and however many threads share the pause."""

from __future__ import annotations

import gc
import threading

import pytest

from gradserve.engine import collector
from gradserve.service import codec


def test_paused_and_restored_even_when_the_work_fails() -> None:
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():  # (nested: one pause)
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(codec.JSONError), collector.paused():
        codec.loads(b"[1, 2")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_threads_share_one_pause_and_the_last_to_end_resumes() -> None:
    inside, release = threading.Barrier(3), threading.Event()

    def work() -> None:
        with collector.paused():
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    with collector.paused():
        release.set()
        threads[0].join()
        threads[1].join()
        assert not gc.isenabled()  # (this pause is still on)
    assert gc.isenabled()
