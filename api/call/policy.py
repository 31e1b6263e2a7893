"""The policy version new calls are stamped with, as the trainer sets it.

In asynchronous RL the weights change while harnesses run, and only the model server sees
which weights served a call. Where the engine reports its version (SGLang's
``meta_info.weight_version``, once set with ``--weight-version`` or
``/update_weight_version``), the call carries that. Elsewhere the trainer tells the front
end: ``PUT /tokcap/policy_version`` (``{"version": "12"}``; with ``auth_secret``, the secret
and never a rollout's token) stores it in the capture store, and every front-end worker on
that store follows it (at once for the worker that took the request, within
``POLL_S`` for the others). Without ``auth_secret`` anyone who reaches the front end may set
it, as anyone may call its model routes. It outlives the run that set it: a trainer sets it
when it starts. A call is stamped with the version current when it was
dispatched, so a call that started before an update keeps the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from api.edge.errors import plain_error
from api.edge.json_body import BodyError, parse_json_object
from api.engine.generation import Generation, with_changes

log = logging.getLogger(__name__)

POLL_S = 0.25
_VERSION = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII without spaces


class PolicyVersion:
    """One worker's view of the trainer's version: what a call dispatched now runs under."""

    def __init__(self, sink: Any) -> None:
        self.current: str | None = None
        self._sink = sink if callable(getattr(sink, "policy_version", None)) else None

    @property
    def shared(self) -> bool:
        """Whether the version lives in the store (else only in this worker)."""
        return self._sink is not None

    def now(self) -> str | None:
        """The version a request sent now is stamped with."""
        return self.current

    async def set(self, version: str) -> None:
        if self._sink is not None:
            await self._sink.set_policy_version(version)
        self.current = version

    async def refresh(self) -> None:
        if self._sink is not None:
            self.current = await self._sink.policy_version()

    async def follow(self) -> None:
        """Read the store's version every ``POLL_S`` until cancelled; an outage keeps the
        last version read (the calls' own capture notes the outage)."""
        while self._sink is not None:
            try:
                await self.refresh()
            except Exception as exc:  # the store's outage is the capture path's to report
                log.debug("policy version not read: %s", exc)
            await asyncio.sleep(POLL_S)


def version_problem(body: Any) -> str | None:
    """Why a ``PUT /tokcap/policy_version`` body names no version, or None."""
    version = body.get("version") if isinstance(body, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and abs(version) < 2**63:
        return None
    if not isinstance(version, str) or not _VERSION.match(version):
        return 'the body must be {"version": ...}: an integer or 1 to 128 printable characters'
    return None


async def policy_version_route(request: Request) -> Response:
    """``GET`` names the version new calls are stamped with; ``PUT`` sets it."""
    if "tokcap_rollout_id" in request.scope:  # a rollout's path: never the trainer's route
        return plain_error(404, "not found")
    policy: PolicyVersion = request.app.state.front_end.policy
    if request.method == "PUT":
        try:
            body: Any = parse_json_object(await request.body())
        except BodyError as exc:
            return plain_error(400, str(exc))
        problem = version_problem(body)
        if problem is not None:
            return plain_error(400, problem)
        try:
            await policy.set(str(body["version"]))
        except Exception as exc:
            return plain_error(503, f"the store did not take it ({type(exc).__name__})")
    elif policy.shared:
        with contextlib.suppress(Exception):
            await policy.refresh()
    return JSONResponse({"version": policy.current, "shared": policy.shared})


def stamped(generation: Generation, dispatched_under: str | None) -> Generation:
    """The generation with the version it ran under: the engine's own report wins over
    the trainer's version when its request was sent (``api.call.updates.Flight``). A
    resumed call's parts each carry their own (``api.call.resume``)."""
    if generation.policy_version is None and dispatched_under is not None:
        generation = with_changes(generation, policy_version=dispatched_under)
    spans = generation.version_spans
    if spans and spans[0][2] is None:  # the first part ran under the version at dispatch
        first = (spans[0][0], spans[0][1], generation.policy_version)
        generation = with_changes(generation, version_spans=(first, *spans[1:]))
    return generation
