"""Rebuild workers as real processes under faults: kill -9 mid-job, many workers, bad jobs,
SIGTERM with jobs in flight, and jobs that keep failing.

Every worker is a ``python -m tokcap.commands.worker`` child (or the slow worker of
``tests.support.rebuild``, the same CLI with a pause between publish and retire) stopped by
its PID; waits are bounded polls of Redis state, never timing assertions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import redis.asyncio as aioredis

from tests.support.rebuild import (
    assert_rebuilt,
    finished_record,
    inspect,
    make_worker,
    nothing_pending,
    populate,
    stream_holds,
    wait_for,
)
from transports.rebuild.jobs import RebuildQueue, encode_job
from transports.rebuild.reader import ResultsReader
from transports.rebuild.results import ensure_group
from transports.redis.keys import stream_names


class WorkerProcess:
    """One worker process with its log in a file (a pipe nobody reads could block it).

    With ``delay_after_publish_ms`` it is the slow worker of ``tests.support.rebuild``,
    which waits that long between publish and retire.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        log_dir: Path,
        name: str,
        *flags: str,
        delay_after_publish_ms: int = 0,
    ) -> None:
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        module = ["tokcap.commands.worker"]
        if delay_after_publish_ms:
            delay = str(delay_after_publish_ms)
            module = ["tests.support.rebuild", "--delay-after-publish-ms", delay]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                *module,
                "--url",
                url,
                "--key-prefix",
                prefix,
                "--consumer",
                name,
                "--block-ms",
                "100",
                *flags,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        assert self.proc.poll() is None, f"worker exited early:\n{self.log()[-3000:]}"

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


async def test_killed_worker_job_is_reclaimed_published_once_retired_after(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    await populate(redis_url, redis_prefix, ["kill-1"], turns=5)
    jobs, results, dead = stream_names(redis_prefix)
    client = redis_client
    first = WorkerProcess(
        redis_url,
        redis_prefix,
        tmp_path,
        "first",
        "--claim-idle-ms",
        "400",
        delay_after_publish_ms=60_000,
    )
    second = None
    try:
        async with RebuildQueue(url=redis_url, stream=jobs) as queue:
            await queue.submit(finished_record("kill-1"))
        published = stream_holds(client, results, 1)
        await wait_for(published, "the first worker to publish", procs=[first])
        # Published, not yet retired, job still pending: now the kill lands mid-job.
        assert (await inspect(redis_url, redis_prefix, "kill-1"))["state"] == "frozen"
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 1
        first.signal(signal.SIGKILL)
        first.wait(10)
        assert (await inspect(redis_url, redis_prefix, "kill-1"))["state"] == "frozen"

        second = WorkerProcess(
            redis_url, redis_prefix, tmp_path, "second", "--claim-idle-ms", "400"
        )
        finished = nothing_pending(client, jobs)
        await wait_for(finished, "the second worker to finish the job", procs=[second])
        assert await client.xlen(results) == 1  # exactly once, though the job ran twice
        assert (await inspect(redis_url, redis_prefix, "kill-1"))["state"] == "retired"
        assert await client.xlen(dead) == 0 and await client.xlen(jobs) == 0
        assert "claimed stale job" in second.log() and "already published" in second.log()
        async with ResultsReader(client=client, stream=results, block_ms=100) as reader:
            (record,) = await reader.read()
        assert_rebuilt(record, turns=5)
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def test_200_jobs_over_3_workers_none_lost_or_duplicated(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    rollout_ids = [f"many-{n:03d}" for n in range(200)]
    await asyncio.gather(
        *(populate(redis_url, redis_prefix, rollout_ids[n::8], turns=2) for n in range(8))
    )
    jobs, results, dead = stream_names(redis_prefix)
    client = redis_client
    workers = [
        WorkerProcess(
            redis_url,
            redis_prefix,
            tmp_path,
            f"w{n}",
            "--concurrency",
            "4",
            "--log-level",
            "warning",
        )
        for n in range(3)
    ]
    try:

        async def all_joined() -> bool:
            await ensure_group(client, jobs, "rebuild")  # so XINFO can be asked early
            return len(await client.xinfo_consumers(jobs, "rebuild")) == 3

        await wait_for(all_joined, "3 workers to join the group", procs=workers)
        async with RebuildQueue(url=redis_url, stream=jobs) as queue:
            for rollout_id in rollout_ids:
                await queue.submit(finished_record(rollout_id))
        async with ResultsReader(client=client, stream=results, block_ms=200) as reader:
            records = []
            deadline = time.monotonic() + 90
            while len(records) < 200:
                assert time.monotonic() < deadline, f"only {len(records)} of 200 results"
                for proc in workers:
                    proc.check_alive()
                records += await reader.read(count=100)
            seen = Counter(record["_ng_rollout_id"] for record in records)
            assert set(seen) == set(rollout_ids) and max(seen.values()) == 1
            assert await client.xlen(results) == 200
            by_worker = Counter(f[b"worker"] for _, f in await client.xrange(results))
            assert set(by_worker) <= {b"w0", b"w1", b"w2"} and len(by_worker) >= 2, by_worker
            for record in records:
                await reader.ack(record)
            assert await client.xlen(results) == 0  # acknowledged results leave the stream
        for record in records[::20]:
            assert_rebuilt(record, turns=2)
        await wait_for(nothing_pending(client, jobs), "every job acked", procs=workers)
        assert await client.xlen(jobs) == 0 and await client.xlen(dead) == 0
        states = Counter(
            [(await inspect(redis_url, redis_prefix, r))["state"] for r in rollout_ids]
        )
        assert states == {"retired": 200}
    finally:
        for proc in workers:
            proc.stop()


async def test_malformed_jobs_go_to_dead_letter_with_readable_errors(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    await populate(redis_url, redis_prefix, ["fine-1"], turns=2)
    jobs, results, dead = stream_names(redis_prefix)
    client = redis_client
    bad = {
        "no record": {"rollout_id": "x"},
        "not msgpack": {"record": b"\xc1\xc1 not msgpack"},
        "invalid id": {"record": msgpack.packb({"_ng_rollout_id": "../etc/passwd"})},
        "no id": {"record": msgpack.packb({"response": {"output": []}})},
        "future": {"v": "9", "record": msgpack.packb({"_ng_rollout_id": "ok-id"})},
    }
    job_ids = {(await client.xadd(jobs, fields)): name for name, fields in bad.items()}
    await client.xadd(jobs, encode_job(finished_record("fine-1")))
    worker = WorkerProcess(redis_url, redis_prefix, tmp_path, "solo")
    try:

        async def settled() -> bool:
            return (
                await client.xlen(dead) == 5
                and await client.xlen(results) == 1
                and (await client.xpending(jobs, "rebuild"))["pending"] == 0
            )

        await wait_for(settled, "5 dead letters, 1 result, nothing pending", procs=[worker])
        letters = {job_ids[fields[b"job_id"]]: fields for _, fields in await client.xrange(dead)}
        errors = {name: fields[b"error"].decode() for name, fields in letters.items()}
        assert "no 'record' field" in errors["no record"]
        assert "not valid msgpack" in errors["not msgpack"]
        assert (
            "invalid rollout id" in errors["invalid id"] and "../etc/passwd" in errors["invalid id"]
        )
        assert "names no rollout" in errors["no id"]
        assert "v9" in errors["future"] and "upgrade tokcap" in errors["future"]
        # The dead letter keeps the job's own fields, so it can be inspected or resubmitted.
        assert letters["not msgpack"][b"record"] == bad["not msgpack"]["record"]
        assert all(fields[b"attempts"] == b"1" for fields in letters.values())
        assert await client.xlen(jobs) == 0
        assert (await inspect(redis_url, redis_prefix, "fine-1"))["state"] == "retired"
    finally:
        worker.stop()


async def test_sigterm_finishes_jobs_in_flight_then_exits(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    rollout_ids = [f"term-{n}" for n in range(4)]
    await populate(redis_url, redis_prefix, rollout_ids, turns=3)
    jobs, results, _ = stream_names(redis_prefix)
    client = redis_client
    worker = WorkerProcess(
        redis_url,
        redis_prefix,
        tmp_path,
        "term",
        "--concurrency",
        "4",
        delay_after_publish_ms=4000,
    )
    try:
        async with RebuildQueue(url=redis_url, stream=jobs) as queue:
            for rollout_id in rollout_ids:
                await queue.submit(finished_record(rollout_id))
        await wait_for(stream_holds(client, results, 4), "4 published results", procs=[worker])
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 4  # all still in flight
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0, worker.log()[-3000:]
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 0
        for rollout_id in rollout_ids:
            assert (await inspect(redis_url, redis_prefix, rollout_id))["state"] == "retired"
        assert "finishing 4 job(s) in flight" in worker.log()
    finally:
        worker.stop()


async def test_job_that_keeps_failing_goes_to_dead_letter_with_its_last_error(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """Attempts are counted by deliveries: a job a worker never finished is retried, then dead."""
    await populate(redis_url, redis_prefix, ["stuck-1"], turns=2)
    jobs, results, dead = stream_names(redis_prefix)
    client = redis_client
    worker = make_worker(
        redis_url, redis_prefix, max_attempts=2, claim_idle_ms=1, consumer="live", concurrency=4
    )
    task = None
    try:
        await worker.start()
        job_id = (await client.xadd(jobs, encode_job(finished_record("stuck-1")))).decode()
        # Two earlier attempts by a worker that died each time; the last one left its error.
        await client.xreadgroup("rebuild", "ghost", {jobs: ">"}, count=1)
        await client.xclaim(jobs, "rebuild", "ghost", 0, [job_id])
        await client.hset(f"{jobs}:errors", job_id, "TimeoutError: upstream took too long")
        await asyncio.sleep(0.01)
        task = asyncio.create_task(worker.run())
        await wait_for(stream_holds(client, dead, 1), "the dead letter", timeout=20)
        ((_, fields),) = await client.xrange(dead)
        assert fields[b"attempts"] == b"3"
        assert b"gave up after 2 attempts" in fields[b"error"]
        assert b"upstream took too long" in fields[b"error"]
        assert await client.xlen(results) == 0 and await client.xlen(jobs) == 0
        assert not await client.exists(f"{jobs}:errors")
        # Nothing was rebuilt, so nothing was retired.
        assert (await inspect(redis_url, redis_prefix, "stuck-1"))["state"] == "open"
    finally:
        worker.stop()
        if task is not None:
            await asyncio.wait_for(task, 20)
        else:
            await worker.close()


async def test_a_failing_step_is_retried_by_reclaim_then_dead_lettered(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """A results stream that cannot take the result (wrong key type) fails every attempt."""
    await populate(redis_url, redis_prefix, ["blocked-1"], turns=2)
    jobs, results, dead = stream_names(redis_prefix)
    client = redis_client
    await client.set(results, "not a stream")
    worker = make_worker(
        redis_url,
        redis_prefix,
        max_attempts=3,
        claim_idle_ms=50,
        block_ms=20,
        consumer="retrier",
        concurrency=4,
    )
    task = asyncio.create_task(worker.run())
    try:
        async with RebuildQueue(client=client, stream=jobs) as queue:
            await queue.submit(finished_record("blocked-1"))
        await wait_for(stream_holds(client, dead, 1), "the dead letter", timeout=30)
        ((_, fields),) = await client.xrange(dead)
        assert fields[b"attempts"] == b"3" and b"WRONGTYPE" in fields[b"error"]
        assert worker.counts["failed"] == 3 and worker.counts["published"] == 0
        # Never published, so never retired: the capture is still there to rebuild later.
        assert (await inspect(redis_url, redis_prefix, "blocked-1"))["state"] == "frozen"
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 0
    finally:
        worker.stop()
        await asyncio.wait_for(task, 20)


async def test_worker_refuses_an_undurable_server(redis_server_factory, tmp_path: Path) -> None:
    server = redis_server_factory(appendonly="no", requirepass="s3cret-pw")
    url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    worker = WorkerProcess(url, "undurable", tmp_path, "refused")
    try:
        assert await asyncio.to_thread(worker.wait, 60) == 1
        assert "AOF is off" in worker.log() and "appendfsync always" in worker.log()
        assert "s3cret-pw" not in worker.log()  # the message names the server, not the URL
    finally:
        worker.stop()
