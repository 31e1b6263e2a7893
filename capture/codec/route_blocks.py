"""Routed experts in content-addressed blocks, shared by prefix like the ids they align with.

A call's routes (``capture.routes.Routes``) are cut into blocks of as many rows as an id
block holds ids, chained from a root of their own (``blocks.routes_root``). The routes of a
prefix do not change when the prefix is extended (the engine routes a position from the
positions before it), so a rollout's next call repeats this call's blocks and stores only
the rows it adds: storage grows with the final context, not with turns x context. Where an
engine routed a repeated prefix differently, the blocks differ and are stored too: each
call keeps exactly the routes it was served with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.codec.blocks import Block, block_ids, chain_names, cut_bytes, routes_root
from capture.routes import Routes


def cut_routes(routes: Routes, block_size: int) -> tuple[list[Block], dict[str, Any]]:
    """The routes' blocks (``block_size`` rows each) and the body fields that name them."""
    row_bytes = routes.row_bytes
    chain = cut_bytes(routes.to_bytes(), block_size * row_bytes, routes_root(row_bytes))
    meta = {
        "tip": chain[-1].name if chain else "",
        "n_blocks": len(chain),
        "rows": routes.rows,
        "layers": routes.layers,
        "top_k": routes.top_k,
    }
    return chain, meta


def routes_from_blocks(
    meta: Mapping[str, Any], blocks: Mapping[str, bytes], cache: dict[Any, Any]
) -> Routes:
    """An entry's routes from its body fields and the rollout's stored blocks.

    The parts are the cached blocks themselves, so the calls of one rollout hold their
    common prefix's rows once (``cache`` is shared across a snapshot)."""
    layers, top_k = int(meta["layers"]), int(meta["top_k"])
    probe = Routes((), 0, layers, top_k)
    root = routes_root(probe.row_bytes).hex()
    names = (
        chain_names(meta["tip"], int(meta["n_blocks"]), blocks, cache, root) if meta["tip"] else []
    )
    parts = [block_ids(name, blocks, cache) for name in names]
    return Routes(parts, int(meta["rows"]), layers, top_k)
