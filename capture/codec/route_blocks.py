"""Routed experts in content-addressed blocks, shared by prefix like the ids they align with.

A call's routes (``capture.routes.Routes``) are cut into blocks of as many rows as an id
block holds ids, chained from a root of their own (``blocks.routes_root``). The routes of a
prefix do not change when the prefix is extended (the engine routes a position from the
positions before it), so a rollout's next call repeats this call's blocks and stores only
the rows it adds: storage grows with the final context, not with turns x context. Where an
engine routed a repeated prefix differently, the blocks differ and are stored too: each
call keeps exactly the routes it was served with.

A put need not hash the prefix again either. Where the front end knows a call continues one
whose routes are stored, it asks the engine only for the rows after a block-aligned start
(vLLM's ``routed_experts_prompt_start``) and hands the store ``ChainedRoutes``: the stored
prefix, named by its blocks, then the new rows' blocks chained from its tip. Those are the
blocks the whole routes would be cut into, so the entry reads back exactly as a whole-routes
entry does; a store that does not hold the prefix refuses the put (``RoutesPrefixError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.codec.blocks import Block, block_ids, chain_names, cut_bytes, routes_root
from capture.errors import RoutesPrefixError
from capture.routes import RouteChain, Routes


class ChainedRoutes:
    """Routes cut at ``block_size`` rows: the first ``len(prefix)`` blocks stored already
    (named only), then ``rest``'s rows cut into blocks chained from the prefix's tip.

    ``prefix`` is the names of a stored chain's first blocks (``Routes.chain``), so these
    routes name every block of their own chain (``chain``) and the next call can reuse any
    whole-block prefix of them. Cutting hashes ``rest`` only: the rows the engine sent.
    """

    __slots__ = ("prefix", "rest", "block_size", "blocks", "chain")

    def __init__(self, rest: Routes, block_size: int, prefix: tuple[str, ...] = ()) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.prefix, self.rest, self.block_size = tuple(prefix), rest, block_size
        parent = bytes.fromhex(prefix[-1]) if prefix else routes_root(rest.row_bytes)
        step = block_size * rest.row_bytes
        self.blocks = tuple(cut_bytes(rest.to_bytes(), step, parent))
        names = self.prefix + tuple(block.name for block in self.blocks)
        self.chain = RouteChain(names, block_size, self.rows)

    @property
    def prefix_rows(self) -> int:
        return len(self.prefix) * self.block_size

    @property
    def rows(self) -> int:
        return self.prefix_rows + self.rest.rows

    @property
    def layers(self) -> int:
        return self.rest.layers

    @property
    def top_k(self) -> int:
        return self.rest.top_k

    @property
    def row_bytes(self) -> int:
        return self.rest.row_bytes

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.layers, self.top_k)

    def __repr__(self) -> str:
        return f"ChainedRoutes(prefix_blocks={len(self.prefix)}, shape={list(self.shape)})"


def reusable_prefix(chain: RouteChain | None, common: int, limit: int) -> tuple[str, ...]:
    """The names of the longest whole-block prefix of ``chain`` that covers at most
    ``common`` rows (the positions whose ids the new call shares with the stored one: a
    row depends on the ids up to its position) and at most ``limit`` rows."""
    if chain is None:
        return ()
    count = min(chain.whole_blocks, min(common, limit) // chain.block_size)
    return chain.names[:count]


def cut_routes(
    routes: Routes | ChainedRoutes, block_size: int
) -> tuple[list[Block], dict[str, Any], tuple[str, ...]]:
    """The blocks to store (``block_size`` rows each), the body fields that name the chain,
    and the names the store must hold already (a ``ChainedRoutes`` prefix's tip)."""
    if isinstance(routes, ChainedRoutes):
        if routes.block_size == block_size:
            return (
                list(routes.blocks),
                _meta(routes, routes.chain.names, block_size),
                routes.prefix[-1:],
            )
        if routes.prefix:
            raise RoutesPrefixError(
                f"routes continue a prefix cut at {routes.block_size} rows a block; this "
                f"store cuts {block_size}"
            )
        routes = routes.rest
    row_bytes = routes.row_bytes
    chain = cut_bytes(routes.to_bytes(), block_size * row_bytes, routes_root(row_bytes))
    return chain, _meta(routes, [block.name for block in chain], block_size), ()


def routes_digest(
    routes: Routes | ChainedRoutes, tip: str, block_size: int, default_size: int
) -> bytes:
    """The routes' part of a payload digest: their shape and tip at ``default_size``, so
    writers with any block size agree.

    Routes that continue a stored prefix cut at another size cannot be cut at the default
    without the prefix's rows: their tip is taken at their own size, which is named."""
    shape = b"%d,%d,%d;" % routes.shape
    if block_size != default_size:
        if isinstance(routes, ChainedRoutes) and routes.prefix:
            return shape + tip.encode() + b"@%d" % block_size
        tip = cut_routes(routes, default_size)[1]["tip"]
    return shape + (tip.encode() if tip else b"-")


def _meta(routes: Routes | ChainedRoutes, names: Any, block_size: int) -> dict[str, Any]:
    return {
        "tip": names[-1] if names else "",
        "n_blocks": len(names),
        "rows": routes.rows,
        "layers": routes.layers,
        "top_k": routes.top_k,
        "block_size": block_size,  # so a reader can name the chain's prefixes (Routes.chain)
    }


def routes_from_blocks(
    meta: Mapping[str, Any], blocks: Mapping[str, bytes], cache: dict[Any, Any]
) -> Routes:
    """An entry's routes from its body fields and the rollout's stored blocks.

    The parts are the cached blocks themselves, so the calls of one rollout hold their
    common prefix's rows once (``cache`` is shared across a snapshot). The routes name
    their blocks (``Routes.chain``; bodies written before the block size was recorded do
    not): a front end that reads a call from the store can ask the engine for the next
    call's new rows only."""
    layers, top_k = int(meta["layers"]), int(meta["top_k"])
    probe = Routes((), 0, layers, top_k)
    root = routes_root(probe.row_bytes).hex()
    names = (
        chain_names(meta["tip"], int(meta["n_blocks"]), blocks, cache, root) if meta["tip"] else []
    )
    parts = [block_ids(name, blocks, cache) for name in names]
    rows, block_size = int(meta["rows"]), meta.get("block_size")
    chain = RouteChain(tuple(names), int(block_size), rows) if block_size else None
    return Routes(parts, rows, layers, top_k, chain)
