"""``tokcap inspect`` on both stores: the fields, the calls and chains, an unknown rollout.

Inspect only reads: a rollout it showed still takes puts. Its calls are linked as a rebuild
links them, without a final answer, so the main chain is the only root's longest path.
"""

from __future__ import annotations

import asyncio
import io
import json
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from tests.support.chains import loop
from tests.support.rollouts import growing_rollout
from tokcap.commands.inspect import UNKNOWN_ROLE, chain_role, inspect_rollout, main, render


def located(store: Any, request: pytest.FixtureRequest) -> dict[str, Any]:
    """How ``inspect_rollout`` reaches the store a test wrote to."""
    if getattr(store, "cluster", False):
        url = request.getfixturevalue("redis_cluster").url
        return {"url": url, "key_prefix": store.key_prefix, "cluster": True}
    if hasattr(store, "key_prefix"):
        return {"url": request.getfixturevalue("redis_url"), "key_prefix": store.key_prefix}
    return {"dir": str(store.dir)}


def flags(where: dict[str, Any]) -> list[str]:
    """The same place as command-line flags."""
    args = []
    for name, value in where.items():
        flag = f"--{name.replace('_', '-')}"
        args += [flag] if value is True else [flag, value]
    return args


def rendered(info: dict[str, Any]) -> str:
    out = io.StringIO()
    render(info, Console(file=out, width=200))
    return out.getvalue()


async def put_loop(store: Any, rollout_id: str, turns: int) -> None:
    for entry in growing_rollout(
        rollout_id, turns, system_tokens=40, generated_per_turn=6, tool_tokens_per_turn=10
    ):
        await store.put(entry)


async def test_an_unknown_rollout_is_an_error_not_an_empty_table(store, request, capsys):
    where = flags(located(store, request))
    for extra in ([], ["--json"]):
        code = await asyncio.to_thread(main, ["nobody-1", *where, *extra])
        out, err = capsys.readouterr()
        assert code == 1 and out == ""
        assert "rollout nobody-1 is unknown to" in err
        assert "nothing was captured for it" in err and "tombstone" in err
        assert "absent" not in err


async def test_calls_are_listed_with_parents_and_chains_without_freezing(
    store, request, make_entry, capsys
):
    await put_loop(store, "tree-1", 3)
    title = make_entry("tree-1", "title", prompt=[1, 2, 3], created_at=1_700_000_010.0)
    await store.put(title)
    info = await inspect_rollout("tree-1", **located(store, request))
    assert info["state"] == "open" and info["calls"] == 4
    parents = {row["call"]: (row["parent"], row["root"]) for row in info["entries"]}
    assert parents == {
        "turn-00000": (None, True),
        "turn-00001": ("turn-00000", False),
        "turn-00002": ("turn-00001", False),
        "title": (None, True),
    }
    assert [row["generated_tokens"] for row in info["entries"]] == [6, 6, 6, 3]
    chains = [(c["root"], c["leaf"], c["calls"], c["main"]) for c in info["chains"]]
    assert chains == [("turn-00000", "turn-00002", 3, False), ("title", "title", 1, False)]
    assert all(isinstance(c["role"], str) and c["role"] for c in info["chains"])
    text = rendered(info)
    assert "calls, oldest first" in text and "chains, root to leaf" in text
    assert "main: none among 2 roots" in text
    # Inspect froze nothing: the running rollout still takes calls.
    await store.put(make_entry("tree-1", "later"))
    code = await asyncio.to_thread(main, ["tree-1", *flags(located(store, request)), "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown["calls"] == 5 and shown["state"] == "open"
    assert shown["store"] and len(shown["entries"]) == 5


async def test_one_root_is_the_main_chain_and_a_retired_rollout_has_no_entries(store, request):
    await put_loop(store, "line-1", 2)
    info = await inspect_rollout("line-1", **located(store, request))
    (chain,) = info["chains"]
    assert chain["main"] and (chain["root"], chain["leaf"]) == ("turn-00000", "turn-00001")
    assert chain["role"] != "" and all(row["main"] for row in info["entries"])
    assert "the only root's longest path" in rendered(info)
    snapshot = await store.freeze("line-1")
    await store.drop("line-1", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    retired = await inspect_rollout("line-1", **located(store, request))
    assert retired["state"] == "retired" and retired["entries"] == retired["chains"] == []
    assert "retired: its entries were dropped" in rendered(retired)


def test_a_chains_role_is_read_wherever_the_builder_puts_it() -> None:
    """On the chain, as the main chain's role, or on the segment ending at its leaf; else ?."""
    leaf = SimpleNamespace(model_call_id="c-9")
    chain = SimpleNamespace(leaf="c-9", main=False)
    assert chain_role(SimpleNamespace(leaf="c-9", main=False, role="title"), object()) == "title"
    main_chain = SimpleNamespace(leaf="c-9", main=True)
    assert chain_role(main_chain, SimpleNamespace(main_role="other")) == "other"
    segment = SimpleNamespace(role="subagent", calls=(SimpleNamespace(model_call_id="c-1"), leaf))
    assert chain_role(chain, SimpleNamespace(segments=(segment,))) == "subagent"
    assert chain_role(chain, SimpleNamespace(segments=(), main_role="")) == UNKNOWN_ROLE


async def test_a_rollout_that_lost_its_first_calls_says_so(store, request):
    """What an evicted and recreated Redis hash leaves: the later calls of a conversation."""
    calls = loop(4, rollout_id="cut-1")
    for call in calls[2:]:
        await store.put(call)
    info = await inspect_rollout("cut-1", **located(store, request))
    notes = {row["call"]: row["notes"] for row in info["entries"]}
    assert any("no captured call sampled" in note for note in notes[calls[2].model_call_id])
    assert notes[calls[3].model_call_id] == []
    assert "calls missing: front-end process w-test had 2" in rendered(info)
