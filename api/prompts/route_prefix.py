"""Routes without the prefix: a faithful call asks the engine only for the rows it adds.

With routes captured, a continued call's routes start with those of the positions it shares
with the call it continues, and the rollout stores those already (``capture.codec.
route_blocks``). The front end knows both prompts' ids before it sends, so:

1. ``prefix_for`` (when the prompt is built): the whole blocks of the continued call's
   stored routes chain whose positions hold the same ids in the new prompt. A row depends
   on the ids up to its position, so a bridge that changed earlier ids (dropped thinking)
   ends the prefix before them; the chain comes from the rollout's own lineage, so another
   rollout's routes are never named;
2. ``routes_start``: the engine is asked for the rows from the prefix's end on (vLLM 0.32's
   ``routed_experts_prompt_start``), where the engine has the field and the call's sink takes
   routes cut at the chain's block size (``capture.protocols.chained_routes_block_size``);
3. ``chained``: the rows that came back are cut into blocks chained from the prefix's tip
   (``ChainedRoutes``), the blocks whole routes would give, so only new rows are hashed and
   the store checks it holds the prefix. Whole routes (a root, a fallback, an engine that
   sent every row) are cut whole, so the next call can name their blocks.

Where any of this cannot be known (text mode, a sink of another kind), routes stay whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from api.engine.generation import Generation, with_changes
from capture.codec.route_blocks import ChainedRoutes, reusable_prefix
from capture.context import current_call
from capture.protocols import chained_routes_block_size
from capture.routes import RouteChain, Routes

# Routes bigger than this are cut in a worker thread, off the event loop (a 100k-token
# context's whole routes take tens of ms to hash).
THREAD_BYTES = 1 << 20


def shared_length(ids: Sequence[int], previous: Sequence[int], step: int) -> int:
    """How many leading ids ``ids`` shares with ``previous``, in whole ``step``s (the
    usual case, ``ids`` extending all of ``previous``, is one comparison)."""
    ids, previous = _as_list(ids), _as_list(previous)
    length = min(len(ids), len(previous))
    if ids[:length] == previous[:length]:
        return length
    shared = 0
    while (
        shared + step <= length and ids[shared : shared + step] == previous[shared : shared + step]
    ):
        shared += step
    return shared


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else list(ids)


def prefix_for(
    chain: RouteChain | None, ids: Sequence[int], previous: Sequence[int]
) -> RouteChain | None:
    """The part of the continued call's routes ``chain`` the call with prompt ``ids`` may
    reuse (``previous``: that call's prompt and generation), or None.

    At least the prompt's last position is asked for (vLLM allows a start up to the
    prompt's length; a reply of no rows would prove nothing)."""
    if chain is None:
        return None
    common = shared_length(ids, previous, chain.block_size)
    names = reusable_prefix(chain, common, len(ids) - 1)
    if not names:
        return None
    return RouteChain(names, chain.block_size, len(names) * chain.block_size)


def _sink_block_size() -> int | None:
    call = current_call()
    return chained_routes_block_size(call.sink) if call is not None else None


def routes_start(prefix: RouteChain | None, client: Any) -> int:
    """The prompt position the engine is asked for routes from: the prefix's end where the
    engine and the sink can take it, else 0 (every row)."""
    if prefix is None or not client.routes_start_allowed():
        return 0
    return prefix.rows if _sink_block_size() == prefix.block_size else 0


async def chained(generation: Generation, prefix: RouteChain | None) -> Generation:
    """The generation with its routes cut into blocks for the sink (``ChainedRoutes``),
    continuing ``prefix`` where the engine sent the rows after it; unchanged where the
    sink does not take them."""
    routes = generation.routed_experts
    size = _sink_block_size()
    if generation.ids_problem is not None or not isinstance(routes, Routes) or size is None:
        return generation
    names: tuple[str, ...] = ()
    if generation.routes_start:
        if prefix is None or generation.routes_start != prefix.rows or size != prefix.block_size:
            problem = f"routes from position {generation.routes_start} continue no stored prefix"
            return with_changes(generation, ids_problem=problem)
        names = prefix.names
    if routes.rows * routes.row_bytes > THREAD_BYTES:
        cut = await asyncio.to_thread(ChainedRoutes, routes, size, names)
    else:
        cut = ChainedRoutes(routes, size, names)
    return with_changes(generation, routed_experts=cut)
