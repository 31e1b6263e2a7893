"""tokcap's capture contract and algorithms; importable without any server stack.

Names are resolved lazily so importing one piece (say, the records) does not load the rest.

The words every package uses, one per concept:

- call: one request the harness sent and the engine answered; its ``entry`` is what was
  captured of it (prompt ids, generated ids, log-probs), put once into the ``sink``.
- lost call: a call whose entry could not be kept; the sink records its loss with
  ``mark_incomplete`` (a Redis ``m:`` field) and the rollout is ``incomplete``. Two ways
  the harness did not get a reply are named apart: ``unserved`` (answered 503, or a stream
  ended with an error event) and ``unreceived`` (the harness hung up after the reply).
- durable: kept through a crash, as the Redis store proves with WAIT or WAITAOF; a call
  that cannot be made durable in time is not answered. ``capture.context.retry_until`` is
  only the retry loop around a put.
- engine: the model server that samples (vLLM, SGLang); an engine adapter
  (``api.engine``) speaks one family's wire; the upstream client (``api.engine.client``) is the
  front end's client of it; the development engine (``tokcap engine``,
  ``tokcap_devtools.engine``) is the test stand-in for one.
- store: what keeps entries, a sink and a source in one: ``FileTokenStore`` (node-local
  files) or ``RedisTokenStore`` (``transports.redis``).
- routes: a call's MoE routed experts (``routed_experts`` on the wire and the entry,
  ``capture.routes.Routes`` in code), one row per position the model read.
- policy version: the weights' version a call ran under (``policy_version``); an engine
  calls it its weight version.
- chain: calls whose prompts extend each other; the main chain is delivered, each other
  chain is reported, or delivered as a ``segment`` (``delivery: segments``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "training_samples": "capture.samples",
    "TrainingSample": "capture.samples",
    # Not capture.step_metrics: importing a submodule of that name first would shadow the
    # function with the module on the package.
    "step_metrics": "capture.metrics",
    "TokenEntry": "capture.records",
    "TokenCaptureSnapshot": "capture.records",
    "SCHEMA_VERSION": "capture.records",
    "TokenSink": "capture.protocols",
    "TokenSource": "capture.protocols",
    "FileTokenStore": "capture.filestore.store",
    "TokenCaptureStore": "capture.filestore.store",  # FileTokenStore's name before
    "TokenIdCaptureConfig": "capture.config",
    "rollout_id_from_run_body": "capture.rollout_ids",
    "validate_rollout_id": "capture.rollout_ids",
    "capture_base_url": "capture.rollout_ids",
    "rollout_token": "capture.rollout_ids",
    "finalize_rollout_token_capture": "capture.delivery",
    "retire_rollout_token_capture": "capture.delivery",
    "MaskFractionGuard": "capture.delivery",
    "run_builder": "capture.build.builder",
    "install_token_source": "capture.registry",
    "install_token_sink": "capture.registry",
    "capture_tokens": "capture.context",
    "capture_call": "capture.context",
    "begin_call": "capture.context",
    "entry_from_response": "capture.extract",
    "IdView": "capture.codec.views",
    "Routes": "capture.routes",
    "json_default": "capture.codec.views",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'capture' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
