"""The policy version a trainer set, kept beside a file store's rollout logs.

Every front-end worker on the directory reads it to stamp new calls, so it is one small
file replaced atomically: a reader sees the old version or the new one, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path

from capture.filestore.log import fsync_dir

POLICY_VERSION_FILE = "policy_version"


def write_policy_version(directory: Path, version: str) -> None:
    """Replace the version, durably."""
    path = directory / POLICY_VERSION_FILE
    scratch = directory / f".{POLICY_VERSION_FILE}.{os.getpid()}.{os.urandom(4).hex()}"
    with open(scratch, "w") as handle:
        handle.write(version)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)
    fsync_dir(directory)


def read_policy_version(directory: Path) -> str | None:
    """The version last written (None: never)."""
    try:
        return (directory / POLICY_VERSION_FILE).read_text() or None
    except FileNotFoundError:
        return None
