"""Errors of the capture contract.

Each one carries a message a user can act on; the capture layer turns every one of them into
an incomplete rollout instead of a failed model call.
"""

from __future__ import annotations


class TokenCaptureError(Exception):
    """Base class of every tokcap capture error."""


class SchemaVersionError(TokenCaptureError):
    """A record was written by a newer tokcap than the one reading it."""


class ExtractionError(TokenCaptureError):
    """A served response does not carry token ids in a usable form."""


class MissingTokenIdsError(ExtractionError):
    """A served response carries no token ids at all."""


class UnconfirmedWriteError(TokenCaptureError):
    """A store may have applied a write but could not confirm it durable in time.

    A later try may confirm it (a replica reconnecting, a promoted master gaining its
    replica), so delivery counts it as the source being unavailable: a rebuild worker
    retries the job instead of publishing a failed build masked.
    """


class RolloutFrozenError(TokenCaptureError):
    """A write reached a rollout that was already frozen (or dropped)."""


class ConflictingEntryError(TokenCaptureError):
    """The same model call id was put twice with different payloads."""


class InvalidRolloutIdError(TokenCaptureError, ValueError):
    """A rollout id does not match the pattern; ids are rejected, never rewritten."""


class ConfigError(TokenCaptureError, ValueError):
    """The token_id_capture configuration is invalid; raised at startup."""


class RoutesPrefixError(TokenCaptureError):
    """An entry's routes continue a stored prefix the store cannot use: the rollout does
    not hold it, or it was cut at another block size. The call is lost, never stored with
    routes the rollout does not hold."""
