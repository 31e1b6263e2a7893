"""tokcap behind a real router (issue 34): the rollout id it sends keeps a rollout on one engine.

A user who already runs a router points ``model_server.upstream`` at it. tokcap sends each
call's rollout id as ``X-SMG-Routing-Key`` and ``X-Session-ID`` (``api.engine.http``); the
router's keyed policy must then send every call of a rollout to one engine. Each router is
the wheel from PyPI, in a venv of its own under the tier's cache, installed on first use
(seconds: a Rust binary and a web stack, no torch) and skipped, with pip's words, where no
wheel for this machine installs:

- ``smg``, the Shepherd Model Gateway: the SGLang Model Gateway, by its maintainers, as it
  went on after ``sglang-router`` 0.3.2. ``consistent_hashing`` hashes X-SMG-Routing-Key.
- ``sglang-router`` 0.3.2, the last of that name on PyPI: no ``consistent_hashing``; ``manual``
  pins each X-SMG-Routing-Key it sees to one worker. It rebuilds each chat request from the
  fields it knows, which lack ``return_token_ids``: tokcap gets no ids through it, and marks
  the calls incomplete.
- ``vllm-router``: ``consistent_hash`` hashes X-Session-ID first.

Two tokcap engines serve behind the router (the wire it fronts; smg fronts both), the front
end in front of it, and 18 rollouts of 3 Messages calls each go through. Which engine sampled
a call is read from the engines' own ground truth: each record's prompt names its rollout.
Each keyed policy runs beside ``round_robin``, which splits rollouts: the check can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from api.engine.probe import EngineRefused
from api.settings import ServerSettings
from api.startup import probe
from tests.real_engines.conftest import _install, cache_root
from tests.support.frontend import (
    assert_entries_equal_ground_truth,
    engine_server,
    file_store_settings,
    freeze,
    front_end,
)
from tests.support.servers import free_port, run_process
from tokcap_devtools.engine.tokenizer import load_tokenizer

# The first test of a router installs it: seconds, unless pip is slow to answer.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]
ROLLOUTS = [f"routed-{n}" for n in range(18)]  # all on one engine: 1 in 131,072
TURNS = 3
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Router:
    """A router on PyPI: its pinned wheel, launcher module, keyed policy, the engine families
    it fronts, the flags it takes beside the common ones, and whether it passes the engine's
    id flags on (``return_token_ids``), so that tokcap captures through it."""

    package: str
    module: str
    keyed: str
    wires: tuple[str, ...]
    extra: tuple[str, ...] = ()
    relays_ids: bool = True


ROUTERS = {
    # Routing over HTTP needs no tokenizer, which smg would otherwise load from the path the
    # worker names (else a hub); a grace period of 0 stops it at once, not after 5 s.
    "smg": Router(
        "smg==1.13.0",
        "smg.launch_router",
        "consistent_hashing",
        ("sglang", "vllm"),
        ("--disable-tokenizer-autoload", "--shutdown-grace-period-secs", "0"),
    ),
    "sglang-router": Router(
        "sglang-router==0.3.2",
        "sglang_router.launch_router",
        "manual",
        ("sglang",),
        relays_ids=False,
    ),
    "vllm-router": Router(
        "vllm-router==0.1.17", "vllm_router.launch_router", "consistent_hash", ("vllm",)
    ),
}
CASES = [
    (name, wire, policy)
    for name, router in ROUTERS.items()
    for wire in router.wires
    for policy in (router.keyed, "round_robin")
]


@functools.cache
def router_python(package: str, module: str) -> Path:
    """The interpreter of a venv with ``package`` alone. Wheels only: where none fits this
    machine, pip says so and the router's tests skip, rather than building Rust here."""
    venv = cache_root() / package.replace("==", "-")
    python = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "--only-binary", ":all:", package],
    ]
    return _install(package, steps, python, module)


def router_command(router: Router, policy: str, workers: list[str], port: int) -> list[str]:
    """The router's command line: the flags a user gives it, all on loopback (metrics on a
    free port of their own, not the shared default 29000)."""
    python = router_python(router.package, router.module)
    return [
        *(str(python), "-m", router.module, "--worker-urls", *workers, "--policy", policy),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
        *router.extra,
    ]


def wait_for_workers(url: str, count: int) -> None:
    """Until the router lists ``count`` healthy workers: smg and sglang-router answer before
    they have registered them, and a call before then finds no worker."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        workers = httpx.get(url + "/workers", timeout=5).json().get("workers", [])
        if len(workers) == count and all(worker.get("is_healthy") for worker in workers):
            return
        assert time.monotonic() < deadline, f"the router never listed {count} workers: {workers}"
        time.sleep(0.1)


@contextlib.contextmanager
def running_router(router: Router, policy: str, workers: list[str]) -> Iterator[str]:
    """The router in front of ``workers`` for the ``with`` block, stopped by PID; its URL."""
    port = free_port()
    command = router_command(router, policy, workers, port)
    url = f"http://127.0.0.1:{port}"
    with run_process(command, ready_url=url + "/health", env={"HF_HUB_OFFLINE": "1"}):
        wait_for_workers(url, len(workers))
        yield url


def converse(front: str, rollout: str) -> None:
    """``TURNS`` Messages calls of one rollout, each with the whole conversation so far, each
    user turn naming the rollout (so the engine's record of the prompt names it too)."""
    sdk = anthropic.Anthropic(
        base_url=f"{front}/ng-rollout/{rollout}/training-token-capture",
        api_key="dummy",
        max_retries=0,
    )
    messages: list[dict[str, Any]] = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Turn {turn} of {rollout}: go on."})
        reply = sdk.messages.create(model="m", max_tokens=64, messages=messages)
        text = "".join(block.text for block in reply.content if block.type == "text")
        messages.append({"role": "assistant", "content": text})


Sampled = dict[str, list[tuple[str, dict[str, Any]]]]


def sampled(engines: list[str]) -> Sampled:
    """Each rollout's calls as the engines recorded them: (engine, record) pairs, the rollout
    read from the record's prompt. Each call is sampled once, by one engine."""
    tokenizer = load_tokenizer()
    found: Sampled = defaultdict(list)
    for url in engines:
        for record in httpx.get(url + "/tokcap/ground_truth", timeout=30).json():
            prompt = tokenizer.decode(record["prompt_token_ids"])
            named = [rollout for rollout in ROLLOUTS if f" of {rollout}:" in prompt]
            assert len(named) == 1, f"a prompt names rollouts {named}: {prompt!r}"
            found[named[0]].append((url, record))
    assert {rollout: len(calls) for rollout, calls in found.items()} == dict.fromkeys(
        ROLLOUTS, TURNS
    )
    return found


def refusal(settings: ServerSettings, engines: list[str]) -> str | None:
    """Why ``tokcap serve``'s start-up probe refuses this upstream, or None where it accepts
    it. The probe asks the router what it would ask an engine and samples one call through
    it, which the engines then forget: their records are the rollouts' calls alone."""
    try:
        asyncio.run(probe(settings))
    except EngineRefused as refused:
        return str(refused)
    finally:
        for url in engines:
            httpx.delete(url + "/tokcap/ground_truth", timeout=30).raise_for_status()
    return None


def check_capture(store: Path, rollout: str, calls: list[tuple[str, dict]], relays: bool) -> None:
    """What the front end stored through the router: each call exactly as its engine sampled
    it; or, through a router that drops the id flags, no entry and the rollout incomplete."""
    snapshot = freeze(store, rollout)
    if relays:
        assert_entries_equal_ground_truth(snapshot, [record for _, record in calls])
    else:
        assert not snapshot.entries and snapshot.incomplete, snapshot


@pytest.mark.parametrize(("name", "wire", "policy"), CASES, ids=["-".join(c) for c in CASES])
def test_the_routers_keyed_policy_keeps_each_rollout_on_one_engine(
    name: str, wire: str, policy: str, tmp_path: Path
) -> None:
    router = ROUTERS[name]
    store = tmp_path / "store"
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(engine_server(wire=wire)) for _ in range(2)]
        url = stack.enter_context(running_router(router, policy, engines))
        settings = file_store_settings(url, store)  # the family detected, as users leave it
        refused = refusal(settings, engines)
        front = stack.enter_context(front_end(settings))
        for rollout in ROLLOUTS:
            converse(front, rollout)
        calls = sampled(engines)
    homes = {rollout: {engine for engine, _ in calls[rollout]} for rollout in ROLLOUTS}
    assert (refused is None) == router.relays_ids, refused
    for rollout in ROLLOUTS:
        check_capture(store, rollout, calls[rollout], router.relays_ids)
    if policy == router.keyed:
        split = {rollout: found for rollout, found in homes.items() if len(found) > 1}
        assert not split, f"{policy} split rollouts across engines: {split}"
        # Both engines take rollouts (all 12 on one would happen once in 2,048 runs).
        assert set().union(*homes.values()) == set(engines)
    else:
        assert any(len(found) > 1 for found in homes.values()), "round_robin split no rollout"
