"""tokcap's capture contract and algorithms; importable without any server stack.

Names are resolved lazily so importing one piece (say, the records) does not load the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "training_samples": "capture.samples",
    "TrainingSample": "capture.samples",
    "TokenEntry": "capture.records",
    "TokenCaptureSnapshot": "capture.records",
    "SCHEMA_VERSION": "capture.records",
    "TokenSink": "capture.protocols",
    "TokenSource": "capture.protocols",
    "TokenCaptureStore": "capture.filestore.store",
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
