"""Rebuild jobs end to end on a real redis-server: submit → worker → results → ack.

Rollouts are written straight into the RedisTokenStore as realistic multi-turn calls (each
prompt extends the previous prompt + generation with tool output), then a finished record is
submitted the way a collector would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from capture.build.projection import project_chain
from capture.codec.entries import decode_entries, encode_entry
from capture.codec.views import IdView, json_default
from capture.routes import Routes
from capture.samples import training_samples
from tests.support.rebuild import (
    assert_rebuilt,
    finished_record,
    inspect,
    populate,
    rollout_entries,
)
from tests.support.rollouts import growing_rollout
from tests.support.routes import routes_for
from tokcap.commands.inspect import inspect_rollout
from transports.rebuild.jobs import (
    MalformedJobError,
    RebuildQueue,
    decode_job,
    encode_job,
)
from transports.rebuild.layout import QueueLayoutError
from transports.rebuild.reader import ResultsReader
from transports.rebuild.results import (
    compact_record,
    decode_result,
    encode_result,
    expand_record,
)
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.worker import RebuildWorker
from transports.redis import RedisTokenStore
from transports.redis.keys import stream_names


async def run_worker_in_task(url: str, prefix: str, **overrides: Any):
    worker = RebuildWorker(
        WorkerSettings(url=url, key_prefix=prefix, claim_idle_ms=60_000, block_ms=100, **overrides)
    )
    return worker, asyncio.create_task(worker.run())


async def read_until(reader: ResultsReader, count: int, timeout: float = 30.0) -> list[dict]:
    records: list[dict] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(records) < count:
        assert asyncio.get_running_loop().time() < deadline, (
            f"only {len(records)} of {count} results"
        )
        records += await reader.read(block_ms=200)
    return records


def test_result_compaction_round_trips_exact_arrays() -> None:
    entries = rollout_entries("compact-1", 5)
    items = [
        {
            "type": "function_call",
            "prompt_token_ids": e.prompt_token_ids,
            "generation_token_ids": e.generation_token_ids,
            "generation_log_probs": e.generation_log_probs,
        }
        for e in entries
    ]
    items.insert(2, {"type": "reasoning", "summary": []})
    record = {"_ng_rollout_id": "compact-1", "response": {"output": items}}
    original = json.loads(json.dumps(record))
    compacted = compact_record(record)
    # Every prompt after the first stores only its tail on the wire.
    tails = [item["prompt_token_ids"] for item in compacted["response"]["output"][3:]]
    assert all(len(tail) == 10 for tail in tails)
    wire = msgpack.unpackb(msgpack.packb(compacted), raw=False)
    assert expand_record(wire) == original
    assert record == original  # compaction never touches the caller's record


def test_a_record_of_views_goes_out_compact_and_comes_back_as_one_shared_sequence() -> None:
    trunk = growing_rollout("views-1", 5, system_tokens=300, generated_per_turn=20)
    branch = trunk[2].model_copy(
        update={"model_call_id": "branch", "generation_token_ids": [7] * 20, "created_at": 0.0}
    )
    encoded = [encode_entry(entry, 64) for entry in [*trunk, branch]]
    blocks = dict(block for item in encoded for block in item.blocks)
    shared = decode_entries([item.body for item in encoded], blocks, trusted=True, shared=True)
    # The trunk, then the branch as its own item: it does not extend the trunk's last call.
    items = [*project_chain(shared[:5]), *project_chain(shared[5:])]
    record = {"_ng_rollout_id": "views-1", "response": {"output": items}}
    want = json.loads(json.dumps(record, default=json_default))
    fields = encode_result(record, rollout_id="views-1")
    wire = msgpack.unpackb(fields["record"], raw=False)["response"]["output"]
    # On the wire: the first prompt whole, then each call's tool output, then the branch whole.
    assert sum(len(item["prompt_token_ids"]) for item in wire) == 300 + 4 * 300 + 940
    back = decode_result("1-0", fields)
    assert (
        json.loads(json.dumps(back["response"]["output"], default=json_default))
        == want["response"]["output"]
    )
    carriers = [item for item in back["response"]["output"] if "prompt_token_ids" in item]
    assert all(type(item["prompt_token_ids"]) is IdView for item in carriers)
    bases = [id(item["prompt_token_ids"].base) for item in carriers]
    assert len(set(bases[:5])) == 1 and bases[5] != bases[0]


async def test_submit_validates_and_round_trips(redis_url: str, redis_prefix: str) -> None:
    jobs, _, _ = stream_names(redis_prefix)
    async with RebuildQueue(url=redis_url, stream=jobs) as queue:
        with pytest.raises(MalformedJobError, match="_ng_rollout_id"):
            await queue.submit({"response": {"output": []}})
        with pytest.raises(ValueError, match="does not match"):
            await queue.submit({"_ng_rollout_id": "no spaces allowed"})
        job_id = await queue.submit(finished_record("sub-1"))
        assert await queue.pending() == 1
        entries = await queue.client.xrange(jobs)
        assert entries[0][0].decode() == job_id
        assert decode_job(entries[0][1]) == ("sub-1", finished_record("sub-1"))
    assert decode_job(encode_job(finished_record("sub-2")))[0] == "sub-2"


async def test_worker_rebuilds_publishes_retires_and_keeps_masked_evidence(
    redis_url: str, redis_prefix: str
) -> None:
    good = [f"good-{n}" for n in range(4)]
    await populate(redis_url, redis_prefix, good, turns=4)
    await populate(redis_url, redis_prefix, ["lossy-0"], turns=4, lose_one=True)
    jobs, results, _ = stream_names(redis_prefix)
    worker, task = await run_worker_in_task(redis_url, redis_prefix, concurrency=3)
    async with RebuildQueue(url=redis_url, stream=jobs) as queue:
        for rollout_id in [*good, "lossy-0"]:
            await queue.submit(finished_record(rollout_id))
    async with ResultsReader(
        url=redis_url, stream=results, group="trainer", consumer="t1", block_ms=200
    ) as reader:
        records = {r["_ng_rollout_id"]: r for r in await read_until(reader, 5)}
        for rollout_id in good:
            assert_rebuilt(records[rollout_id], turns=4)
            assert (await inspect(redis_url, redis_prefix, rollout_id))["state"] == "retired"
        lossy = records["lossy-0"]
        assert lossy["mask_sample"] is True
        assert lossy["_ng_token_capture"]["capture_incomplete"] is True
        # A masked build is never retired: its calls stay as evidence.
        info = await inspect(redis_url, redis_prefix, "lossy-0")
        assert info["state"] == "frozen" and info["calls"] == 4
        for record in records.values():
            assert await reader.ack(record)
    worker.stop()
    await asyncio.wait_for(task, 30)
    assert worker.counts["published"] == 5 and worker.counts["retired"] == 4
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.xlen(jobs) == 0  # acked jobs are deleted
        assert (await client.xpending(jobs, "rebuild"))["pending"] == 0
        assert (await client.xpending(results, "trainer"))["pending"] == 0
    finally:
        await client.aclose()


async def test_publish_is_once_per_snapshot_even_when_a_job_runs_twice(
    redis_url: str, redis_prefix: str
) -> None:
    await populate(redis_url, redis_prefix, ["twice-1"], turns=3, lose_one=True)
    jobs, results, _ = stream_names(redis_prefix)
    worker = RebuildWorker(WorkerSettings(url=redis_url, key_prefix=redis_prefix))
    await worker.start()
    fields = encode_job(finished_record("twice-1"))
    try:
        await worker.process("1-1", fields)  # a re-run: same rollout, same frozen snapshot
        await worker.process("1-1", fields)
        await worker.process("2-1", fields)  # a duplicate submission of the same rollout
        entries = await worker.client.xrange(results)
    finally:
        await worker.close()
    assert len(entries) == 1
    assert entries[0][1][b"rollout_id"] == b"twice-1"
    assert entries[0][1][b"masked"] == b"1"


async def test_unacked_results_are_delivered_again(redis_url: str, redis_prefix: str) -> None:
    rollout_ids = ["redo-0", "redo-1", "redo-2"]
    await populate(redis_url, redis_prefix, rollout_ids, turns=2)
    jobs, results, _ = stream_names(redis_prefix)
    worker, task = await run_worker_in_task(redis_url, redis_prefix, concurrency=2)
    async with RebuildQueue(url=redis_url, stream=jobs) as queue:
        for rollout_id in rollout_ids:
            await queue.submit(finished_record(rollout_id))
    reader_options = dict(url=redis_url, stream=results, group="trainer", block_ms=200)
    async with ResultsReader(consumer="t1", **reader_options) as reader:
        first = await read_until(reader, 3)
        await reader.ack(first[0])  # only this handoff became durable
        assert await reader.read(block_ms=50) == []  # nothing handed out twice while alive
    # The trainer restarts under the same name: the two unacked records come back.
    async with ResultsReader(consumer="t1", **reader_options) as reader:
        again = await read_until(reader, 2)
        assert sorted(r["_ng_rollout_id"] for r in again) == sorted(
            r["_ng_rollout_id"] for r in first[1:]
        )
        assert (
            again[0]["response"]
            == next(r for r in first if r["_ng_rollout_id"] == again[0]["_ng_rollout_id"])[
                "response"
            ]
        )
    # Another trainer takes over what t1 left unacked once it has been idle long enough.
    async with ResultsReader(consumer="t2", claim_idle_ms=1, **reader_options) as reader:
        await asyncio.sleep(0.01)
        taken = await read_until(reader, 2)
        for record in taken:
            await reader.ack(record["_ng_result_id"])
        assert await reader.read(block_ms=50) == []
        # Every result was acknowledged, and acknowledged results leave the stream.
        assert await reader.client.xlen(results) == 0
    worker.stop()
    await asyncio.wait_for(task, 30)


def _cli(command: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run one subcommand's module, as ``tokcap <command>`` would."""
    return subprocess.run(
        [sys.executable, "-m", f"tokcap.commands.{command}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_submit_and_inspect_commands(redis_url: str, redis_prefix: str, tmp_path) -> None:
    await populate(redis_url, redis_prefix, ["cli-1"], turns=3)
    jobs, _, _ = stream_names(redis_prefix)
    path = tmp_path / "record.json"
    path.write_text(json.dumps(finished_record("cli-1")))
    done = await asyncio.to_thread(
        _cli, "submit", "--url", redis_url, "--key-prefix", redis_prefix, str(path)
    )
    assert done.returncode == 0, done.stderr
    assert "cli-1" in done.stdout
    client = aioredis.Redis.from_url(redis_url)
    try:
        ((job_id, fields),) = await client.xrange(jobs)
        assert done.stdout.split()[0] == job_id.decode()
        assert decode_job(fields) == ("cli-1", finished_record("cli-1"))
    finally:
        await client.aclose()
    bad = await asyncio.to_thread(
        _cli, "submit", "--url", redis_url, "--stream", jobs, "-", stdin=json.dumps({"reward": 1.0})
    )
    assert bad.returncode == 2 and "_ng_rollout_id" in bad.stderr
    shown = await asyncio.to_thread(
        _cli, "inspect", "cli-1", "--url", redis_url, "--key-prefix", redis_prefix
    )
    assert shown.returncode == 0, shown.stderr
    assert "open" in shown.stdout and "generated_tokens" in shown.stdout
    assert "durability" not in shown.stderr  # the opt-out warning is about writes
    as_json = await asyncio.to_thread(
        _cli, "inspect", "cli-1", "--url", redis_url, "--key-prefix", redis_prefix, "--json"
    )
    info = json.loads(as_json.stdout)
    assert info["calls"] == 3 and info["state"] == "open" and info["tombstone"] is False
    helped = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tokcap.cli", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "--concurrency" in helped.stdout


async def test_inspect_holds_back_the_opt_out_warning_for_its_call_only(
    redis_url: str, redis_prefix: str, caplog
) -> None:
    await populate(redis_url, redis_prefix, ["quiet-1"], turns=2)
    logger = logging.getLogger("tokcap.redis")
    level = logger.level
    with caplog.at_level(logging.WARNING, logger="tokcap.redis"):
        info = await inspect_rollout("quiet-1", url=redis_url, key_prefix=redis_prefix)
        assert info["calls"] == 2
        assert not [r for r in caplog.records if "durability='none'" in r.getMessage()]
        logger.warning("after inspect")  # the logger itself still speaks
        assert "after inspect" in caplog.text
    assert logger.level == level and not logger.filters


async def test_inspect_command_reads_a_file_store(tmp_path) -> None:
    from capture.filestore.store import FileTokenStore

    store = FileTokenStore(tmp_path / "captures")
    try:
        for entry in rollout_entries("file-1", 2):
            await store.put(entry)
        await store.freeze("file-1")
    finally:
        await store.close()
    shown = await asyncio.to_thread(
        _cli, "inspect", "file-1", "--dir", str(tmp_path / "captures"), "--json"
    )
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["state"] == "frozen" and info["calls"] == 2 and info["generated_tokens"] == 12
    missing = await asyncio.to_thread(_cli, "inspect", "file-1", "--dir", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "not a directory" in missing.stderr


async def test_a_queue_refuses_a_second_shard_layout(
    redis_url: str, redis_prefix: str, tmp_path
) -> None:
    """Submitter, workers and trainer given different shards would stall without a word."""
    await populate(redis_url, redis_prefix, ["lay-1"], turns=2)
    jobs, results, _ = stream_names(redis_prefix)
    async with RebuildQueue(url=redis_url, stream=jobs, shards=2) as queue:
        await queue.submit(finished_record("lay-1"))
    worker = RebuildWorker(WorkerSettings(url=redis_url, key_prefix=redis_prefix, shards=3))
    try:
        with pytest.raises(QueueLayoutError, match="has 2 shards, but this worker was given 3"):
            await worker.start()
    finally:
        await worker.close()
    async with RebuildQueue(url=redis_url, stream=jobs, shards=2) as queue:
        await queue.submit(finished_record("lay-1"))  # the same layout goes on
    # A worker with the queue's layout records it for the results too; a trainer reading
    # one stream is then told, and so is a submitter with another count.
    worker = RebuildWorker(WorkerSettings(url=redis_url, key_prefix=redis_prefix, shards=2))
    try:
        await worker.start()
        async with ResultsReader(url=redis_url, stream=results, group="t") as reader:
            with pytest.raises(QueueLayoutError, match=f"delete {results}.layout"):
                await reader.read(block_ms=10)
    finally:
        await worker.close()
    path = tmp_path / "record.json"
    path.write_text(json.dumps(finished_record("lay-1")))
    done = await asyncio.to_thread(
        _cli, "submit", "--url", redis_url, "--key-prefix", redis_prefix, str(path)
    )
    assert done.returncode == 2 and "has 2 shards, but this submitter was given 1" in done.stderr


async def test_routes_and_versions_reach_the_trainer_through_the_worker(
    redis_url: str, redis_prefix: str
) -> None:
    """Each call's routes and policy version, stored in Redis, come out of the results
    stream on the carriers and in training_samples, and the metrics name the versions and
    the lag to the consumer's version the job record carries."""
    entries = rollout_entries("moe-0", 6)
    store = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    try:
        for turn, entry in enumerate(entries):
            entry.routed_experts = Routes.from_array(routes_for(entry.full_sequence))
            entry.policy_version = "4" if turn < 3 else "5"
            await store.put(entry)
    finally:
        await store.close()
    jobs, results, _ = stream_names(redis_prefix)
    worker, task = await run_worker_in_task(redis_url, redis_prefix)
    record = finished_record("moe-0") | {"_ng_current_policy_version": 7}
    async with RebuildQueue(url=redis_url, stream=jobs) as queue:
        await queue.submit(record)
    async with ResultsReader(
        url=redis_url, stream=results, group="trainer", consumer="t1", block_ms=200
    ) as reader:
        [result] = await read_until(reader, 1)
        await reader.ack(result)
    worker.stop()
    await asyncio.wait_for(task, 30)
    assert result["mask_sample"] is False
    metrics = result["_ng_token_capture"]
    assert metrics["policy_versions"] == ["4", "5"] and metrics["policy_version_lag"] == 3
    carriers = [i for i in result["response"]["output"] if "generation_token_ids" in i]
    assert [c["routed_experts"] for c in carriers] == [e.routed_experts for e in entries]
    assert [c["policy_version"] for c in carriers] == [e.policy_version for e in entries]
    [sample] = training_samples(result)
    assert (sample.routed_experts.to_numpy()[:-1] == routes_for(sample.input_ids)).all()
    assert [version for *_, version in sample.policy_versions] == ["4"] * 3 + ["5"] * 3
