"""The group commit's sync threads: jobs at once, each one's error, nothing after shutdown."""

from __future__ import annotations

import threading

import pytest

from capture.filestore.crew import SyncCrew


def test_jobs_run_at_once_and_each_answers_with_its_own_error():
    crew = SyncCrew(4, "test-sync")
    started = threading.Barrier(5, timeout=10)  # only met when all five run together
    ran: list[str] = []

    def job(n: int):
        def run() -> None:
            started.wait()
            ran.append(threading.current_thread().name)
            if n % 2:
                raise OSError(n, "disk said no")

        return run

    errors = crew.errors_of([job(n) for n in range(5)])
    assert [e.errno if e else None for e in errors] == [None, 1, None, 3, None]
    assert ran.count(threading.current_thread().name) == 1  # the caller ran the first job
    assert len(set(ran)) == 5
    crew.shutdown()


def test_threads_start_as_batches_need_them_up_to_the_size():
    crew = SyncCrew(3, "test-sync")
    assert crew.errors_of([lambda: None]) == [None]
    assert crew._threads == []  # one job runs on the caller alone
    crew.errors_of([lambda: None] * 3)
    assert len(crew._threads) == 2
    crew.errors_of([lambda: None] * 10)  # ten jobs share three threads and the caller
    assert len(crew._threads) == 3
    crew.shutdown()


def test_a_shut_down_crew_refuses_a_batch_it_would_need_and_its_threads_end():
    crew = SyncCrew(2, "test-sync")
    crew.errors_of([lambda: None] * 3)
    crew.shutdown()
    for thread in crew._threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        crew.errors_of([lambda: None] * 2)
    assert crew.errors_of([lambda: None]) == [None]  # the caller alone still runs one
