"""Views of the codec the tests check: a prompt's blocks, an entry's digest, a body's chain."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.codec.blocks import chain_names, cut
from capture.codec.entries import DEFAULT_BLOCK_SIZE, encode_entry, read_body
from capture.codec.packed import pack_ids


def prompt_blocks(ids: list[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[tuple[str, bytes]]:
    """Cut ids into (chained digest, packed ids) blocks of ``block_size`` ids."""
    return [(block.name, block.data) for block in cut(pack_ids(ids), block_size)]


def entry_digest(entry: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """The canonical payload digest used by the idempotency check (any block size)."""
    return encode_entry(entry, block_size).digest


def body_block_names(body: bytes, blocks: Mapping[str, bytes]) -> list[str]:
    """The block names a stored body's chain runs through, first block first."""
    data = read_body(body)
    return chain_names(data["tip"], data["n_blocks"], blocks)
