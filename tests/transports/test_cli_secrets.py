"""The commands need a named Redis and never print its password.

``submit``, ``worker`` and ``inspect`` refuse (exit 2) without ``--url`` or
TOKCAP_REDIS_URL instead of guessing 127.0.0.1:6379. Against a password-protected private
redis-server, with the URL in the environment as the README passes it, no help text, log
line, message, result or dead letter shows the password; and every option of every verb
says its default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.support.rebuild import finished_record, populate
from tokcap.cli import DefaultsHelpFormatter, build_parser
from tokcap_devtools.processes import stop_process

SECRET = "redis-pw-5be0d4"
UPSTREAM_SECRET = "upstream-pw-c3a9"
OWN_VERBS = ("serve", "worker", "submit", "inspect", "report", "engine")


def _environ(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOKCAP_")}
    return {**environ, **extra}


def tokcap(
    *args: str, env: dict[str, str], stdin: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokcap.cli", *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "argv",
    [["worker"], ["submit", "-"], ["inspect", "some-rollout"]],
    ids=["worker", "submit", "inspect"],
)
def test_no_url_is_a_clear_error(argv: list[str]) -> None:
    done = tokcap(*argv, env=_environ(), stdin="{}")
    assert done.returncode == 2, done.stderr
    assert "--url" in done.stderr and "TOKCAP_REDIS_URL" in done.stderr
    assert "Traceback" not in done.stderr


def test_help_names_the_variables_never_their_values() -> None:
    env = _environ(
        TOKCAP_REDIS_URL=f"redis://:{SECRET}@127.0.0.1:1/0",
        TOKCAP_UPSTREAM=f"http://user:{UPSTREAM_SECRET}@127.0.0.1:1",
        TOKCAP_ENGINE_API_KEY=UPSTREAM_SECRET,
    )
    for verb in (*OWN_VERBS, "demo"):
        done = tokcap(verb, "--help", env=env)
        assert done.returncode == 0, done.stderr
        for secret in (SECRET, UPSTREAM_SECRET):
            assert secret not in done.stdout + done.stderr, verb
    worker_help = tokcap("worker", "--help", env=env).stdout
    assert "$TOKCAP_REDIS_URL" in worker_help


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


@pytest.mark.parametrize("verb", OWN_VERBS)
def test_every_option_says_its_default(verb: str) -> None:
    sub = _subparsers()[verb]
    formatter = DefaultsHelpFormatter(f"tokcap {verb}")
    for action in sub._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if action.default is argparse.SUPPRESS:  # --help
            continue
        assert action.help, f"tokcap {verb} {action.option_strings[0]} has no help"
        shown = formatter._get_help_string(action)
        assert "default" in shown, f"tokcap {verb} {action.option_strings[0]}: {shown}"


class _Running:
    """A ``tokcap worker`` child with its output in a file, stopped by its PID."""

    def __init__(self, log: Path, env: dict[str, str], *args: str) -> None:
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokcap.cli", "worker", *args],
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> str:
        stop_process(self.proc)
        self._out.close()
        return self.log.read_text(errors="replace")


async def _streams_text(client: aioredis.Redis, prefix: str) -> str:
    """Every entry of every stream under ``prefix``, as text."""
    text = []
    async for key in client.scan_iter(match=f"{prefix}:*"):
        if await client.type(key) == b"stream":
            for _, fields in await client.xrange(key):
                text.append(repr(fields))
    return "\n".join(text)


async def _wait_for(client: aioredis.Redis, stream: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while await client.xlen(stream) < count:
        assert time.monotonic() < deadline, f"{stream} has fewer than {count} entries"
        await asyncio.sleep(0.1)


async def test_no_password_in_any_output_of_the_redis_commands(
    redis_server_factory, redis_prefix: str, tmp_path: Path
) -> None:
    server = redis_server_factory(requirepass=SECRET)
    url = f"redis://:{SECRET}@127.0.0.1:{server.port}/0"
    env = _environ(TOKCAP_REDIS_URL=url)
    await populate(url, redis_prefix, ["secret-1"], turns=2)
    records = tmp_path / "records.jsonl"
    lines = [finished_record("secret-1"), finished_record("secret-2")]
    records.write_text("\n".join(json.dumps(record) for record in lines))
    outputs = {}
    submitted = await asyncio.to_thread(
        tokcap, "submit", "--key-prefix", redis_prefix, str(records), env=env
    )
    assert submitted.returncode == 0, submitted.stderr
    outputs["submit"] = submitted.stdout + submitted.stderr
    worker = _Running(
        tmp_path / "worker.log",
        env,
        "--key-prefix",
        redis_prefix,
        "--block-ms",
        "100",
        "--log-level",
        "debug",
    )
    client = aioredis.Redis.from_url(url)
    try:
        await _wait_for(client, f"{redis_prefix}:results", 2, timeout=60)
        # A job that cannot be rebuilt goes to the dead-letter stream with its error.
        await client.xadd(f"{redis_prefix}:rebuild", {"record": b"not json"})
        await _wait_for(client, f"{redis_prefix}:rebuild:dead", 1, timeout=60)
        streams = await _streams_text(client, redis_prefix)
    finally:
        outputs["worker"] = worker.stop()
        await client.aclose()
    assert "secret-1" in streams  # the results are there, and hold no password
    outputs["streams"] = streams
    for argv in (
        ("inspect", "secret-1", "--key-prefix", redis_prefix),
        ("inspect", "never-captured", "--key-prefix", redis_prefix),
        ("report", "--key-prefix", redis_prefix),
    ):
        done = await asyncio.to_thread(tokcap, *argv, env=env)
        assert done.returncode in (0, 1), done.stderr
        outputs[" ".join(argv[:2])] = done.stdout + done.stderr
    assert f"127.0.0.1:{server.port}" in outputs["inspect never-captured"]
    wrong = f"redis://:wrong-{SECRET}@127.0.0.1:{server.port}/0"
    for argv in (
        ("inspect", "secret-1"),
        ("report",),
        ("submit", str(records)),
        ("worker", "--block-ms", "100"),
    ):
        done = await asyncio.to_thread(tokcap, *argv, env=_environ(TOKCAP_REDIS_URL=wrong))
        assert done.returncode != 0, (argv, done.stdout)
        outputs[f"{argv[0]} (wrong password)"] = done.stdout + done.stderr
    for where, text in outputs.items():
        assert SECRET not in text, f"the password is in the output of {where}: {text[-2000:]}"
