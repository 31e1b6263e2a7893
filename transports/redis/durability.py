"""Whether a Redis server can make each write durable before the writer is told "done".

Checked once at start-up, because a put that returns must survive a crash of the server.
``fsync`` (the default) needs AOF with ``appendfsync always``, or a server with ``WAITAOF``
(Redis >= 7.2) so every write can wait for its local fsync. ``replicas:N`` waits for N
replicas with ``WAIT`` after every write. ``none`` is an explicit, logged opt-out. A server
that cannot prove the chosen guarantee is refused with the setting to change.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from capture.errors import ConfigError, UnconfirmedWriteError
from transports.redis.keys import as_text

_REPLICAS = re.compile(r"^replicas:([1-9][0-9]*)$")
_WAITAOF_SINCE = (7, 2)

# Runs one Redis command and returns its raw reply.
Execute = Callable[..., Awaitable[Any]]


class DurabilityError(UnconfirmedWriteError):
    """The server did not confirm that a write is durable; the write may still be stored."""


@dataclass(frozen=True)
class Durability:
    """The chosen guarantee, and what each write sends after EXEC to obtain it."""

    mode: str  # "fsync" | "replicas" | "none"
    replicas: int = 0
    wait: tuple[tuple[Any, ...], ...] = ()  # commands sent after EXEC on the same connection
    how: str = ""  # how the guarantee is met, for logs and errors

    @classmethod
    def parse(cls, text: str) -> Durability:
        if text in ("fsync", "none"):
            return cls(mode=text)
        match = _REPLICAS.match(text) if isinstance(text, str) else None
        if match:
            return cls(mode="replicas", replicas=int(match.group(1)))
        raise ConfigError(
            f"durability must be 'fsync', 'replicas:N' (N >= 1) or 'none', got {text!r}"
        )

    def verify(self, replies: Sequence[Any]) -> None:
        """Check the replies to ``wait``; raise if the write was not confirmed durable."""
        if not self.wait:
            return
        reply = replies[0]
        if self.wait[0][0] == "WAITAOF":
            local = int(reply[0])
            if local < 1:
                raise DurabilityError(
                    "WAITAOF timed out before the local AOF was fsynced; the write may be lost"
                )
        elif int(reply) < self.replicas:
            raise DurabilityError(
                f"WAIT: only {int(reply)} of {self.replicas} replicas acknowledged the write "
                "in time; it may be lost if the primary fails"
            )


def info_fields(raw: Any) -> dict[str, str]:
    """INFO as text fields, whether the reply is raw or was parsed into a dict by redis-py."""
    if isinstance(raw, dict):
        return {as_text(name): as_text(value) for name, value in raw.items()}
    lines = as_text(raw).splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line and not line.startswith("#"))


def _version(info: dict[str, str]) -> tuple[int, ...]:
    return tuple(int(part) for part in info.get("redis_version", "0").split(".")[:2])


async def _config(execute: Execute, name: str) -> str | None:
    """A CONFIG GET value, or None when CONFIG is disabled or renamed (managed Redis)."""
    try:
        reply = await execute("CONFIG", "GET", name)
    except ResponseError:
        return None
    if isinstance(reply, dict):
        values = list(reply.values())
    else:
        values = list(reply)[1::2]
    return as_text(values[0]) if values else ""


async def check_durability(
    execute: Execute, chosen: Durability, *, where: str, wait_timeout_ms: int
) -> Durability:
    """Prove the chosen guarantee against the server at ``where``, or refuse it (``none``,
    the explicit opt-out, proves nothing; the store logs it once, at start-up)."""
    if chosen.mode == "none":
        return chosen
    if chosen.mode == "replicas":
        return await _prove_replicas(execute, chosen.replicas, where, wait_timeout_ms)
    return await _prove_fsync(execute, where, wait_timeout_ms)


async def _prove_replicas(
    execute: Execute, replicas: int, where: str, wait_timeout_ms: int
) -> Durability:
    """A primary with enough connected replicas; every write then waits for them."""
    info = info_fields(await execute("INFO", "replication"))
    connected = int(info.get("connected_slaves", "0"))
    if info.get("role") != "master" or connected < replicas:
        raise ConfigError(
            f"durability='replicas:{replicas}' but {where} is a "
            f"{info.get('role', 'unknown')} with {connected} connected replicas; attach "
            f"at least {replicas} replicas, or choose durability='fsync'"
        )
    wait = (("WAIT", replicas, wait_timeout_ms),)
    return Durability("replicas", replicas, wait, f"WAIT {replicas}")


async def _prove_fsync(execute: Execute, where: str, wait_timeout_ms: int) -> Durability:
    """AOF with appendfsync always, or AOF on a server whose writes can wait with WAITAOF."""
    server = info_fields(await execute("INFO", "server"))
    has_waitaof = _version(server) >= _WAITAOF_SINCE
    waitaof = Durability("fsync", 0, (("WAITAOF", 1, 0, wait_timeout_ms),), "WAITAOF 1 0")
    appendonly = await _config(execute, "appendonly")
    if appendonly is None:
        persistence = info_fields(await execute("INFO", "persistence"))
        if has_waitaof and persistence.get("aof_enabled") == "1":
            return waitaof
        raise ConfigError(
            f"cannot prove durability of {where}: CONFIG is disabled there (managed Redis?) "
            "and WAITAOF is not available with AOF on; choose a durability mode explicitly: "
            "durability='replicas:N' if it has replicas, or durability='none' to opt out"
        )
    if appendonly != "yes":
        hint = " (or, on Redis >= 7.2, appendonly yes alone: tokcap then waits with WAITAOF)"
        raise ConfigError(
            f"AOF is off on {where}: set appendonly yes and appendfsync always{hint}, "
            "or pass durability='replicas:N' or durability='none'"
        )
    appendfsync = await _config(execute, "appendfsync")
    if appendfsync == "always":
        return Durability("fsync", 0, (), "appendfsync always")
    if has_waitaof:
        return waitaof
    raise ConfigError(
        f"appendfsync is {appendfsync!r} on {where} (Redis {server.get('redis_version')}, "
        "no WAITAOF before 7.2): set appendfsync always, or upgrade to Redis >= 7.2, "
        "or pass durability='replicas:N' or durability='none'"
    )
