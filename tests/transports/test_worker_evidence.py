"""The worker never destroys evidence (issue 8, item 7), on a real redis-server.

A poison record is dead-lettered before anything is frozen or published, so a later valid
job of the same rollout gets the real result and retires it. A snapshot is retired only when
the result the trainer receives is this snapshot's unmasked build. A late loss mark after
publish makes the worker publish a masked result that supersedes the first one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import redis.asyncio as aioredis

from capture.delivery import RolloutBuild
from tests.support.rebuild import (
    assert_rebuilt,
    finished_record,
    inspect,
    make_worker,
    nothing_pending,
    populate,
    results_of,
    rollout_entries,
    stream_holds,
    wait_for,
)
from tests.support.servers import free_port
from transports.rebuild.jobs import encode_job
from transports.rebuild.reader import ResultsReader
from transports.rebuild.results import SUPERSEDES_KEY
from transports.redis import RedisTokenStore
from transports.redis.keys import publish_guard_key, stream_names

POISON = {
    "response text": lambda rid: {"_ng_rollout_id": rid, "response": "done"},
    "output text": lambda rid: {"_ng_rollout_id": rid, "response": {"output": "done"}},
    "output missing": lambda rid: {"_ng_rollout_id": rid, "response": {"id": "resp_1"}},
    "not an object": lambda rid: ["not", "a", "record"],
}


def poison_fields(rollout_id: str, shape: str) -> dict[str, Any]:
    """A job as a careless collector could XADD it: the rollout named, the record unusable."""
    return {
        "v": "1",
        "rollout_id": rollout_id,
        "format": "msgpack",
        "record": msgpack.packb(POISON[shape](rollout_id), use_bin_type=True),
    }


async def test_poison_jobs_then_a_valid_one_the_valid_result_wins_and_retires(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    await populate(redis_url, redis_prefix, ["poisoned-1"], turns=3)
    jobs, results, dead = stream_names(redis_prefix)
    client = redis_client
    worker = make_worker(redis_url, redis_prefix)
    await worker.start()
    for shape in POISON:
        await client.xadd(jobs, poison_fields("poisoned-1", shape))
    await client.xadd(jobs, encode_job(finished_record("poisoned-1")))
    task = asyncio.create_task(worker.run())
    try:

        async def settled() -> bool:
            done = worker.counts["done"] == 1
            lettered = await stream_holds(client, dead, len(POISON))()
            return lettered and await nothing_pending(client, jobs)() and done

        await wait_for(settled, "the dead letters and the valid job")
        letters = [fields for _, fields in await client.xrange(dead)]
        assert all(b"cannot be rebuilt" in f[b"error"] for f in letters[:3]), letters
        assert b"must be an object" in letters[3][b"error"]
        assert all(f[b"rollout_id"] == b"poisoned-1" for f in letters)
        (record,) = await results_of(client, results)  # the poison published nothing
        assert record["_ng_rollout_id"] == "poisoned-1" and SUPERSEDES_KEY not in record
        assert_rebuilt(record, turns=3)
        assert record["_fields"]["ok"] == b"1" and record["_fields"]["masked"] == b"0"
        assert (await inspect(redis_url, redis_prefix, "poisoned-1"))["state"] == "retired"
        assert worker.counts["dead"] == len(POISON) and worker.counts["retired"] == 1
    finally:
        worker.stop()
        await asyncio.wait_for(task, 20)


async def test_a_poison_job_alone_is_dead_lettered_and_leaves_the_rollout_open(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, redis_store: RedisTokenStore
) -> None:
    await populate(redis_url, redis_prefix, ["alone-1"], turns=2)
    jobs, results, dead = stream_names(redis_prefix)
    store, client = redis_store, redis_client
    worker = make_worker(redis_url, redis_prefix)
    await worker.start()
    job_id = (await client.xadd(jobs, poison_fields("alone-1", "output text"))).decode()
    await client.xreadgroup("rebuild", worker.settings.consumer, {jobs: ">"}, count=1)
    try:
        ((_, fields),) = await client.xrange(jobs)
        await worker._run_job(job_id, fields, 1)
        ((_, letter),) = await client.xrange(dead)
        assert b"response.output must be a list" in letter[b"error"]
        assert letter[b"job_id"].decode() == job_id and letter[b"attempts"] == b"1"
        assert await client.xlen(results) == 0 and await client.xlen(jobs) == 0
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 0
        assert worker.counts["dead"] == 1 and worker.counts["published"] == 0
        assert not await client.keys(f"{results}:*")  # no publish guard names a snapshot
        info = await inspect(redis_url, redis_prefix, "alone-1")
        assert info["state"] == "open" and info["calls"] == 2
        # Not frozen: the harness may still write, and nothing of it was lost.
        later = rollout_entries("alone-1", 3)[-1]
        await store.put(later)
        assert (await store.inspect("alone-1"))["calls"] == 3
    finally:
        await worker.close()


async def test_an_existing_masked_publish_guard_keeps_the_snapshot(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, redis_store: RedisTokenStore
) -> None:
    """The trainer received a masked result for this snapshot: its evidence must stay."""
    await populate(redis_url, redis_prefix, ["guarded-1", "legacy-1"], turns=3)
    jobs, results, _ = stream_names(redis_prefix)
    store, client = redis_store, redis_client
    worker = make_worker(redis_url, redis_prefix)
    await worker.start()
    try:
        guards = {}
        for rollout_id, value in (("guarded-1", "1-0 0"), ("legacy-1", "1-0")):
            # A masked result (or one of an older worker, which did not say) came first.
            snapshot = await store.freeze(rollout_id)
            guard = publish_guard_key(results, rollout_id, snapshot.snapshot_id, snapshot.version)
            await client.set(guard, value)
            guards[rollout_id] = guard
            await worker.process("9-1", encode_job(finished_record(rollout_id)))
            info = await inspect(redis_url, redis_prefix, rollout_id)
            assert info["state"] == "frozen" and info["calls"] == 3, (rollout_id, info)
            assert (await client.get(guard)).decode() == value
        assert await client.xlen(results) == 0  # already published: nothing new was written
        assert worker.counts["retired"] == 0 and worker.counts["masked"] == 2
        # An unmasked guard of this very snapshot, by contrast, lets the same job retire it.
        await client.set(guards["guarded-1"], "1-0 1")
        await worker.process("9-2", encode_job(finished_record("guarded-1")))
        assert (await inspect(redis_url, redis_prefix, "guarded-1"))["state"] == "retired"
    finally:
        await worker.close()


async def test_a_late_loss_after_publish_is_superseded_by_a_masked_result(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, redis_store: RedisTokenStore
) -> None:
    await populate(redis_url, redis_prefix, ["late-1"], turns=3)
    _, results, _ = stream_names(redis_prefix)
    store, client = redis_store, redis_client
    worker = make_worker(redis_url, redis_prefix, delay_after_publish_s=1.5)
    await worker.start()
    try:
        job = asyncio.create_task(worker.process("5-1", encode_job(finished_record("late-1"))))
        await wait_for(stream_holds(client, results, 1), "the first result")
        await store.mark_incomplete("late-1", "turn-lost")  # inside the publish → retire window
        await asyncio.wait_for(job, 30)
        first, second = await results_of(client, results)
        assert_rebuilt(first, turns=3)
        assert SUPERSEDES_KEY not in first and "supersedes" not in first["_fields"]
        assert second["mask_sample"] is True
        assert second["_ng_token_capture"]["capture_incomplete"] is True
        assert second[SUPERSEDES_KEY] == first["_ng_result_id"]
        assert second["_fields"]["supersedes"].decode() == first["_ng_result_id"]
        assert second["_fields"]["snapshot_id"] == first["_fields"]["snapshot_id"]
        assert int(second["_fields"]["version"]) > int(first["_fields"]["version"])
        # The superseding record is rebuilt from the job's record, not the mutated one.
        assert second["response"]["output"] == finished_record("late-1")["response"]["output"]
        info = await inspect(redis_url, redis_prefix, "late-1")
        assert info["state"] == "frozen" and info["calls"] == 3  # the evidence stays
        counts = worker.counts
        assert counts["superseded"] == 1 and counts["retire_refused"] == 1
        assert counts["published"] == 2 and counts["retired"] == 0 and counts["done"] == 1
        # The trainer sees the link on the record it reads.
        async with ResultsReader(client=client, stream=results, block_ms=50) as reader:
            read = await reader.read()
        assert [r.get(SUPERSEDES_KEY) for r in read] == [None, first["_ng_result_id"]]
        # A re-run of the job (a claimed copy) publishes nothing new and retires nothing.
        await worker.process("5-1", encode_job(finished_record("late-1")))
        assert await client.xlen(results) == 2
        assert (await inspect(redis_url, redis_prefix, "late-1"))["state"] == "frozen"
    finally:
        await worker.close()


async def test_a_rerun_after_a_crash_still_links_the_superseded_result(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, redis_store: RedisTokenStore
) -> None:
    """The worker died after publish; the late mark came; the claimed re-run links them."""
    await populate(redis_url, redis_prefix, ["crash-1"], turns=3)
    _, results, _ = stream_names(redis_prefix)
    store, client = redis_store, redis_client
    dying = make_worker(redis_url, redis_prefix, delay_after_publish_s=60)
    second = make_worker(redis_url, redis_prefix, consumer="second")
    await dying.start()
    await second.start()
    fields = encode_job(finished_record("crash-1"))
    try:
        job = asyncio.create_task(dying.process("6-1", fields))
        await wait_for(stream_holds(client, results, 1), "the first result")
        job.cancel()  # killed between publish and retire
        await asyncio.gather(job, return_exceptions=True)
        await store.mark_incomplete("crash-1", "turn-lost")
        await second.process("6-1", fields)
        first, again = await results_of(client, results)
        assert first["mask_sample"] is False and again["mask_sample"] is True
        assert again[SUPERSEDES_KEY] == first["_ng_result_id"]
        assert second.counts["superseded"] == 1 and second.counts["retired"] == 0
        assert (await inspect(redis_url, redis_prefix, "crash-1"))["state"] == "frozen"
    finally:
        await dying.close()
        await second.close()


async def test_an_older_build_is_never_published_after_a_newer_one(
    redis_url: str, redis_prefix: str
) -> None:
    """Two jobs of one rollout raced a late mark: the slower one's older build is stale."""
    _, results, _ = stream_names(redis_prefix)
    worker = make_worker(redis_url, redis_prefix)
    await worker.start()
    record = finished_record("race-1")
    newer = RolloutBuild(rollout_id="race-1", snapshot_id="s1", version=3, status="masked")
    older = RolloutBuild(rollout_id="race-1", snapshot_id="s1", version=2, status="ok")
    other = RolloutBuild(rollout_id="race-1", snapshot_id="s2", version=1, status="ok")
    try:
        written = await worker._publish("7-1", "race-1", dict(record), newer)
        assert written.fresh and not written.ok and not written.stale
        stale = await worker._publish("7-2", "race-1", dict(record), older)
        assert stale.stale and not stale.fresh and stale.result_id == written.result_id
        assert await worker.client.xlen(results) == 1
        again = await worker._publish("7-1", "race-1", dict(record), newer)
        assert not again.fresh and again.result_id == written.result_id and not again.ok
        # Another snapshot of the rollout (after an administrative delete) links nothing.
        fresh = await worker._publish("7-3", "race-1", dict(record), other)
        assert fresh.fresh and fresh.ok and fresh.supersedes == ""
    finally:
        await worker.close()


async def test_a_build_that_cannot_reach_the_store_is_retried_never_published(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """The results stream answers but the capture store does not: no masked result."""
    await populate(redis_url, redis_prefix, ["unreachable-1"], turns=2)
    jobs, results, dead = stream_names(redis_prefix)
    client = redis_client
    worker = make_worker(redis_url, redis_prefix, max_attempts=3)
    await worker.start()
    live_source = worker.source
    worker.source = RedisTokenStore(
        url=f"redis://127.0.0.1:{free_port()}/0", key_prefix=redis_prefix, max_retries=1
    )
    job_id = (await client.xadd(jobs, encode_job(finished_record("unreachable-1")))).decode()
    await client.xreadgroup("rebuild", worker.settings.consumer, {jobs: ">"}, count=1)
    try:
        ((_, fields),) = await client.xrange(jobs)
        await worker._run_job(job_id, fields, 1)
        assert await client.xlen(results) == 0 and await client.xlen(dead) == 0
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 1  # kept for a retry
        error = (await client.hget(f"{jobs}:errors", job_id)).decode()
        assert "TransientJobError" in error and "unreachable" in error
        assert worker.counts["failed"] == 1 and worker.counts["published"] == 0
        assert (await inspect(redis_url, redis_prefix, "unreachable-1"))["state"] == "open"
        # The store is back: the retry publishes the real result and retires it.
        await worker.source.close()
        worker.source = live_source
        await worker._run_job(job_id, fields, 2)
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 0
        (record,) = await results_of(client, results)
        assert_rebuilt(record, turns=2)
        assert (await inspect(redis_url, redis_prefix, "unreachable-1"))["state"] == "retired"
    finally:
        if worker.source is not live_source:
            await worker.source.close()
            worker.source = live_source
        await worker.close()
