"""What a sink and a source must do; structural, so nobody has to inherit.

A sink records calls while a rollout runs: ``put`` is durable before it returns, the same
call id with the same payload is a no-op, a different payload fails and marks the rollout
incomplete, and nothing succeeds after freeze. A source ends a rollout: ``freeze`` returns
one atomic snapshot and blocks every later write; ``drop`` retires exactly that snapshot and
leaves a tombstone so a late writer still sees the freeze.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from capture.records import TokenCaptureSnapshot, TokenEntry


@runtime_checkable
class TokenSink(Protocol):
    async def put(self, entry: TokenEntry) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...

    async def close(self) -> None: ...


def reads_packed_ids(sink: Any) -> bool:
    """Whether ``sink`` takes an entry whose prompt is ``capture.codec.packed.PackedIds``.

    tokcap's own stores say so (``reads_packed_ids = True``): they prove a long prompt
    extends the last one with one memcmp. Any other sink is handed lists, as ``TokenEntry``
    promises.
    """
    return getattr(sink, "reads_packed_ids", False) is True


def chained_routes_block_size(sink: Any) -> int | None:
    """The block size at which ``sink`` takes routes that continue a stored prefix
    (``capture.codec.route_blocks.ChainedRoutes``), or None when it does not take them.

    tokcap's own stores say so (``reads_chained_routes = True`` and their ``block_size``):
    they check the rollout holds the prefix before storing. Any other sink is handed whole
    routes.
    """
    if getattr(sink, "reads_chained_routes", False) is not True:
        return None
    size = getattr(sink, "block_size", None)
    return size if isinstance(size, int) and size > 0 else None


@runtime_checkable
class IntentSink(Protocol):
    """Optional extension: a durable intent recorded before the call is dispatched.

    An intent without an entry at freeze time makes the snapshot incomplete. ``void_call``
    resolves an intent whose call returned nothing to the harness (it does not mask).
    """

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None: ...

    async def void_call(self, rollout_id: str, model_call_id: str) -> None: ...


@runtime_checkable
class ReceiptSink(Protocol):
    """Optional extension: a durable note that the harness never received a call's reply.

    The front end writes it when the client disconnected before the reply (or the stream's
    final event) went out, or when it answered 503 because the capture could not be made
    durable. It resolves the call's intent (not a loss), and the builder leaves the call's
    entry, if any, out of the rebuild unless a later call extends it. Like a loss mark it
    is refused after freeze (``RolloutFrozenError``); the caller then records a loss.
    """

    async def mark_unreceived(self, rollout_id: str, model_call_id: str) -> None: ...


@runtime_checkable
class StartupCheck(Protocol):
    """Optional extension: a sink that proves itself before it takes its first call.

    The Redis store proves its durability guarantee here, so a server that cannot keep it
    fails the worker at start-up rather than a harness's call.
    """

    async def start(self) -> None: ...


@runtime_checkable
class LineageSource(Protocol):
    """Optional extension: a running rollout's call found by a lineage key on its entry.

    Faithful prompts (``capture.lineage``) continue the call a request's history ends in;
    a store that answers this lets any worker or node continue any rollout. Returns None
    when no stored entry carries the key (or the rollout is unknown).
    """

    async def find_call(self, rollout_id: str, lineage_key: str) -> TokenEntry | None: ...


@runtime_checkable
class TokenSource(Protocol):
    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot: ...

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...

    async def close(self) -> None: ...


SINK_METHODS = ("put", "mark_incomplete", "close")
SOURCE_METHODS = ("freeze", "drop", "close")


def missing_methods(obj: Any, names: tuple[str, ...]) -> list[str]:
    """Names of the required methods ``obj`` lacks or cannot call."""
    return [name for name in names if not callable(getattr(obj, name, None))]
