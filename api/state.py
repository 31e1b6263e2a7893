"""What one front-end worker's routes read: its settings, its parts and their metrics.

One typed object on ``app.state.front_end`` instead of loose attributes, so the hop to the
engines (``engines``) and the sink are visible to a reader and to type checkers alike. The
parts a lifespan builds (the engine pool, the prompts, the policy version) are set
when the worker starts, before any request is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from api.call.collisions import CollisionWatch
from api.call.policy import PolicyVersion
from api.call.updates import WeightUpdates
from api.edge.metrics import FrontEndMetrics
from api.edge.prefix import SinkSlot
from api.engine.pool import EnginePool
from api.prompts.faithful import FaithfulPrompts
from api.settings import ServerSettings


@dataclass
class FrontEnd:
    """One worker's front end; ``engines`` and ``policy`` exist once its lifespan began."""

    settings: ServerSettings
    metrics: FrontEndMetrics
    slot: SinkSlot
    collisions: CollisionWatch
    updates: WeightUpdates
    prompts: FaithfulPrompts | None = None
    _engines: EnginePool | None = field(default=None, repr=False)
    _policy: PolicyVersion | None = field(default=None, repr=False)

    @property
    def engines(self) -> EnginePool:
        if self._engines is None:
            raise RuntimeError("the front end's lifespan has not started: no engines")
        return self._engines

    @property
    def policy(self) -> PolicyVersion:
        if self._policy is None:
            raise RuntimeError("the front end's lifespan has not started: no policy version")
        return self._policy

    def started(
        self, engines: EnginePool, prompts: FaithfulPrompts | None, policy: PolicyVersion
    ) -> None:
        self._engines, self.prompts, self._policy = engines, prompts, policy


def front_end(request: Request) -> FrontEnd:
    """The front end of the worker serving ``request``."""
    state: FrontEnd = request.app.state.front_end
    return state
