"""Rollout ids: how a run body names its rollout, and the base URL that carries it.

``_ng_rollout_id`` on the run body wins; otherwise ``{task}-{rollout}`` from the Gym indices,
with ``-a{n}`` for attempt n > 0. An id that breaks the pattern is rejected, never rewritten:
a rewritten id would silently merge or split rollouts.

A collector that names rollouts by training step writes ``step{N}.{task}-{rollout}``;
``step_of_rollout_id`` reads the N back, so a report can group results by step without a
field of its own. Any other id names no step.

A rollout token is the key a rollout's harness sends with its calls when the front end has
an auth secret: the secret's HMAC of the rollout id, so a harness that knows its own token
cannot derive another rollout's, and the front end checks it without storing anything.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any

from capture.errors import InvalidRolloutIdError

ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ROLLOUT_ID_MAX_LEN = 200
STEP_ID_PATTERN = re.compile(r"^step([0-9]+)\.")  # step{N}.{task}-{rollout}
ROLLOUT_PREFIX = "ng-rollout"
CAPTURE_SEGMENT = "training-token-capture"
# Marks a rollout token in a header or a log a user pastes; the secret never starts with it.
ROLLOUT_TOKEN_PREFIX = "tkr_"


def validate_rollout_id(rollout_id: Any) -> str:
    """Return the id unchanged, or raise naming the rule it breaks."""
    if not isinstance(rollout_id, str):
        raise InvalidRolloutIdError(f"rollout id must be a string, got {type(rollout_id).__name__}")
    if len(rollout_id) > ROLLOUT_ID_MAX_LEN:
        raise InvalidRolloutIdError(
            f"rollout id is {len(rollout_id)} characters long; the limit is {ROLLOUT_ID_MAX_LEN}"
        )
    if not ROLLOUT_ID_PATTERN.match(rollout_id) or rollout_id.endswith("\n"):
        raise InvalidRolloutIdError(
            f"rollout id {rollout_id!r} does not match {ROLLOUT_ID_PATTERN.pattern} "
            "(start with a letter or digit; then letters, digits, '.', '_' or '-')"
        )
    return rollout_id


def _index(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRolloutIdError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def rollout_id_from_run_body(body: Mapping[str, Any]) -> str | None:
    """The rollout id a Gym run body names, or None when it names none."""
    explicit = body.get("_ng_rollout_id")
    if explicit is not None:
        return validate_rollout_id(explicit)
    task = _index(body, "_ng_task_index")
    rollout = _index(body, "_ng_rollout_index")
    if task is None or rollout is None:
        return None
    rollout_id = f"{task}-{rollout}"
    attempt = _index(body, "_ng_attempt_index") or _index(body, "_ng_attempt") or 0
    if attempt > 0:
        rollout_id += f"-a{attempt}"
    return validate_rollout_id(rollout_id)


def step_of_rollout_id(rollout_id: str | None) -> int | None:
    """The N of a ``step{N}.`` that opens the id, or None: the id names no step."""
    found = STEP_ID_PATTERN.match(rollout_id) if rollout_id else None
    return int(found.group(1)) if found else None


def capture_base_url(base_url: str, rollout_id: str, training: bool = True) -> str:
    """``<base>/ng-rollout/<id>/training-token-capture``; without ``training`` no capture."""
    validate_rollout_id(rollout_id)
    url = f"{base_url.rstrip('/')}/{ROLLOUT_PREFIX}/{rollout_id}"
    return f"{url}/{CAPTURE_SEGMENT}" if training else url


def rollout_token(secret: str, rollout_id: str) -> str:
    """The key of one rollout: ``tkr_`` + hex HMAC-SHA256 of the rollout id keyed by the secret.

    The collector hands it to the rollout's harness as its API key (``ANTHROPIC_API_KEY``,
    ``OPENAI_API_KEY``); the front end accepts it on that rollout's paths only.
    """
    if not secret:
        raise ValueError("rollout_token needs the front end's auth secret, got an empty one")
    validate_rollout_id(rollout_id)
    digest = hmac.new(secret.encode(), rollout_id.encode(), hashlib.sha256).hexdigest()
    return ROLLOUT_TOKEN_PREFIX + digest


def split_capture_path(path: str) -> tuple[str | None, bool, str]:
    """Split a request path into (rollout id, captured, remaining api path).

    Paths without the prefix come back as (None, False, path). The id is returned as sent;
    the caller validates it so an invalid id is answered with the rule, not served.
    """
    parts = path.split("/", 3)
    # ['', 'ng-rollout', '<id>', 'rest...']
    if len(parts) < 3 or parts[0] != "" or parts[1] != ROLLOUT_PREFIX:
        return None, False, path
    rollout_id = parts[2]
    rest = "/" + parts[3] if len(parts) > 3 else "/"
    segment = "/" + CAPTURE_SEGMENT
    if rest == segment or rest.startswith(segment + "/"):
        return rollout_id, True, rest[len(segment) :] or "/"
    return rollout_id, False, rest
