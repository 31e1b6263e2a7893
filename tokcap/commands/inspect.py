"""``tokcap inspect <rollout_id>``: what is captured for one rollout, from Redis or a directory.

Read-only: nothing is frozen, so a running rollout goes on. It shows the store's
``inspect()`` (``capture.inspection.Inspection``: calls, tokens, state, version, incomplete,
tombstone), then the entries stored now (the store's ``peek()``) linked as a rebuild links
them: each call with its parent, and each chain from root to leaf with its role where the
builder names one. Inspect has no final answer, so the main chain is the only root's
longest path, or none among several roots; a rebuild picks the chain whose last call gave
the record's final answer. A rollout the store holds nothing of is an error (exit 1), not
an empty table: the id, the store or the key prefix is wrong, or all of it expired.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from inspect import signature
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from capture.build.builder import BuildResult, ChainInfo, run_builder
from capture.build.lost_calls import lost_calls
from capture.errors import InvalidRolloutIdError
from capture.records import TokenEntry
from capture.retention import EVIDENCE_TTL_S, TOMBSTONE_TTL_S
from capture.rollout_ids import validate_rollout_id
from tokcap.commands.redis_url import URL_ENV, add_cluster_argument, named_url
from tokcap.help import verb_main
from transports.redis.keys import DEFAULT_PREFIX

UNKNOWN_ROLE = "?"  # the builder names no role for this chain
GRAPH_KEYS = (
    "main_chain_by",
    "entries",
    "chains",
    "lost_calls",
)  # what inspect adds to the store's fields


class UnknownRolloutError(LookupError):
    """The store holds nothing of the rollout: no entry, intent, mark or tombstone."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rollout_id", help="the rollout to show")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"Redis URL of a Redis store (default ${URL_ENV})")
    where.add_argument("--dir", help="directory of a file store")
    parser.add_argument(
        "--key-prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default %(default)s)"
    )
    add_cluster_argument(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


async def inspect_rollout(
    rollout_id: str,
    *,
    url: str | None = None,
    dir: str | None = None,
    key_prefix: str = DEFAULT_PREFIX,
    cluster: bool = False,
) -> dict[str, Any]:
    """The store's ``inspect()`` for one rollout, where it was read, its calls and chains.

    Raises ``UnknownRolloutError`` when the store holds nothing of the rollout.
    """
    store = _open_store(url, dir, key_prefix, cluster)
    try:
        # The store's warning about durability='none' is about writes: it would only
        # confuse a reader, so it is held back for this call and nothing else.
        with _errors_only(logging.getLogger("tokcap.redis")):
            info = await store.inspect(rollout_id)
            entries = await store.peek(rollout_id) if info["state"] != "absent" else []
        where = _where(store)
    finally:
        await store.close()
    if info["state"] == "absent":
        raise UnknownRolloutError(unknown_message(rollout_id, where, redis=dir is None))
    return {**info, "store": where, **call_graph(entries)}


def _open_store(url: str | None, dir: str | None, key_prefix: str, cluster: bool) -> Any:
    if dir is not None:
        from capture.filestore.store import FileTokenStore

        if not Path(dir).is_dir():
            raise FileNotFoundError(f"{dir} is not a directory of a file store")
        return FileTokenStore(dir)
    from transports.redis import RedisTokenStore

    # Read-only: no write needs the durability guarantee, so none is demanded.
    return RedisTokenStore(url=url, key_prefix=key_prefix, durability="none", cluster=cluster)


def _where(store: Any) -> str:
    """The store, for messages: a Redis server and key prefix, or a directory."""
    if hasattr(store, "key_prefix"):
        return f"{store.where}, key prefix {store.key_prefix!r}"
    return f"the file store in {store.dir}"


def _days(seconds: float) -> str:
    return f"{seconds / 86400:g} days"


def unknown_message(rollout_id: str, where: str, *, redis: bool) -> str:
    """Why a store can hold nothing of a rollout, as far as that kind of store can tell."""
    head = f"rollout {rollout_id} is unknown to {where}: nothing was captured for it there"
    if redis:
        return (
            f"{head}, or everything it left has expired or was deleted (a tombstone expires "
            f"tombstone_ttl_s after retirement, {_days(TOMBSTONE_TTL_S)} by default; a frozen "
            f"rollout never retired, evidence_ttl_s after its freeze, {_days(EVIDENCE_TTL_S)} "
            "by default)"
        )
    return (
        f"{head}, or it was retired and its tombstone swept (tombstone_ttl_s after "
        f"retirement, {_days(TOMBSTONE_TTL_S)} by default), or it was deleted"
    )


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def _errors_only(logger: logging.Logger) -> Iterator[None]:
    """Let only errors of ``logger`` through inside the block; it is left as it was."""
    held_back = _ErrorsOnly()
    logger.addFilter(held_back)
    try:
        yield
    finally:
        logger.removeFilter(held_back)


# -- calls and chains, as a rebuild without a final answer links them --------------------


def call_graph(entries: list[TokenEntry]) -> dict[str, Any]:
    """Each call with its parent, each chain with its role, and calls the store lost; no
    final answer is given."""
    build = _build(entries)
    ordered = sorted(entries, key=lambda entry: (entry.created_at, entry.model_call_id))
    return {
        "main_chain_by": build.main_chain_by,
        "entries": [_call_row(entry, build) for entry in ordered],
        "chains": [_chain_row(chain, build) for chain in build.chains],
        "lost_calls": lost_calls(entries),
    }


def _build(entries: list[TokenEntry]) -> BuildResult:
    # A builder that can deliver every chain as a segment also names each segment's role;
    # asking for segments only labels the chains here, since nothing is delivered.
    if "delivery" in signature(run_builder).parameters:
        return run_builder(entries, delivery="segments")
    return run_builder(entries)


def _call_row(entry: TokenEntry, build: BuildResult) -> dict[str, Any]:
    call_id = entry.model_call_id
    linked = call_id in build.parents
    return {
        "call": call_id,
        "prompt_tokens": len(entry.prompt_token_ids),
        "generated_tokens": len(entry.generation_token_ids),
        "parent": build.parents.get(call_id),
        "root": linked and build.parents[call_id] is None,
        "main": call_id in build.main_chain,
        "notes": _call_notes(call_id, build),
    }


def _call_notes(call_id: str, build: BuildResult) -> list[str]:
    """What the rebuild did with a call besides linking it."""
    unresolved = {call for group in build.unresolved_retries for call in group}
    notes = {
        "no generated tokens: set aside": build.empty_generation,
        "same as an earlier call: folded into it": getattr(build, "identical_retries", ()),
        "ambiguous parent: several identical calls precede it": build.quarantined,
        "retry whose sibling was extended: discarded": build.discarded_retries,
        "retry, and none of its group was extended": unresolved,
        "its request carries assistant turns no captured call sampled: seeded (few-shot "
        "examples, a resumed session), or calls before it were lost (see the mask "
        "reasons)": build.seeded_roots,
        "nothing captured leads to this conversation: not delivered as a segment (a second "
        "harness run under this rollout id?)": build.unexplained_roots,
    }
    return [note for note, calls in notes.items() if call_id in calls]


def _chain_row(chain: ChainInfo, build: BuildResult) -> dict[str, Any]:
    return {
        "root": chain.root,
        "leaf": chain.leaf,
        "calls": chain.calls,
        "generated_tokens": chain.generated_tokens,
        "main": chain.main,
        "quarantined": chain.quarantined,
        "role": chain_role(chain, build),
    }


def chain_role(chain: Any, build: Any) -> str:
    """The chain's role where the builder names one: on the chain itself, as the main
    chain's role, or on the segment that ends with the chain's leaf; else ``?``."""
    role = getattr(chain, "role", None)
    if not role and chain.main:
        role = getattr(build, "main_role", None)
    if not role:
        by_leaf = {
            getattr(calls[-1], "model_call_id", None): getattr(segment, "role", None)
            for segment in getattr(build, "segments", None) or ()
            if (calls := getattr(segment, "calls", None))
        }
        role = by_leaf.get(chain.leaf)
    return str(role) if role else UNKNOWN_ROLE


# -- output ----------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value)) if value else "-"
    if value is None or value == "":
        return "-"
    return str(value)


def _fields_table(info: dict[str, Any]) -> Table:
    table = Table(title=f"rollout {info.get('rollout_id', '')}", show_header=True)
    table.add_column("field", style="bold")
    table.add_column("value")
    for name, value in info.items():  # capture.inspection.Inspection's order, then the store
        if name not in GRAPH_KEYS:
            table.add_row(name, _cell(value))
    return table


def _calls_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="calls, oldest first")
    for name in ("call", "prompt tokens", "generated tokens", "parent", "main", "notes"):
        table.add_column(name, justify="right" if "tokens" in name else "left")
    for row in rows:
        parent = "root" if row["root"] else row["parent"]
        table.add_row(
            row["call"],
            str(row["prompt_tokens"]),
            str(row["generated_tokens"]),
            _cell(parent),
            "yes" if row["main"] else "",
            "; ".join(row["notes"]),
        )
    return table


def _chains_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="chains, root to leaf")
    for name in ("root", "leaf", "calls", "generated tokens", "main", "role"):
        table.add_column(name, justify="right" if name in ("calls", "generated tokens") else "left")
    for row in rows:
        table.add_row(
            row["root"],
            row["leaf"],
            str(row["calls"]),
            str(row["generated_tokens"]),
            "yes" if row["main"] else "no",
            row["role"] + (" (ambiguous call)" if row["quarantined"] else ""),
        )
    return table


def _main_chain_note(info: dict[str, Any]) -> str:
    """How the main chain above was chosen, and how a rebuild would choose it."""
    if not info["entries"]:
        dropped = " (retired: its entries were dropped)" if info.get("tombstone") else ""
        return f"no entries stored{dropped}"
    if not info["chains"]:
        return "no chains: no call generated any tokens"
    rebuild = "a rebuild delivers the chain whose last call gave the record's final answer"
    if info["main_chain_by"] == "only_root":
        return f"main: the only root's longest path, as no final answer is given here; {rebuild}"
    roots = len({chain["root"] for chain in info["chains"]})
    return f"main: none among {roots} roots without a final answer; {rebuild}"


def render(info: dict[str, Any], console: Console) -> None:
    console.print(_fields_table(info))
    if info["entries"]:
        console.print(_calls_table(info["entries"]))
        console.print(_chains_table(info["chains"]))
    console.print(_main_chain_note(info), highlight=False)
    for lost in info.get("lost_calls", ()):
        console.print(lost, highlight=False)


def run(args: argparse.Namespace) -> int:
    try:
        validate_rollout_id(args.rollout_id)
    except InvalidRolloutIdError as exc:
        print(f"tokcap inspect: {exc}", file=sys.stderr)
        return 2
    url = None if args.dir else named_url(args.url)  # --url and --dir exclude each other
    if url is None and args.dir is None:
        print(f"tokcap inspect: give --url URL (or set {URL_ENV}) or --dir DIR", file=sys.stderr)
        return 2
    try:
        info = asyncio.run(
            inspect_rollout(
                args.rollout_id,
                url=url,
                dir=args.dir,
                key_prefix=args.key_prefix,
                cluster=args.cluster,
            )
        )
    except UnknownRolloutError as exc:
        print(f"tokcap inspect: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"tokcap inspect: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, default=str))
    else:
        render(info, Console())
    return 0


def main(argv: list[str] | None = None) -> int:
    return verb_main("tokcap inspect", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
