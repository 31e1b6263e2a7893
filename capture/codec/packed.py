"""Ids and log-probs in packed little-endian form, and ``PackedIds``: a prompt kept packed.

The codec stores ids as uint32 and log-probs as float64. The front end's id check already
packs a reply's prompt to uint32 (``api.engine.generation``); an entry that carries those bytes as
``PackedIds`` lets the codec prove that a long prompt extends the prefix it encoded last
time with one ``memcmp`` instead of a pass over a list of Python ints, and take the new ids'
bytes without packing them again. A put then costs the ids the call adds, at any context.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from capture.codec.listlike import ListLikeIds

_LITTLE = sys.byteorder == "little"
ID_WIDTH = 4  # bytes per packed id


def _pack(values: Iterable[int | float], typecode: str) -> bytes:
    packed = array(typecode, values)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes | memoryview, typecode: str) -> list[Any]:
    unpacked = array(typecode)
    unpacked.frombytes(data)
    if not _LITTLE:
        unpacked.byteswap()
    return unpacked.tolist()


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 (a ``PackedIds``'s bytes as they are)."""
    if isinstance(ids, PackedIds):
        return ids.data
    try:
        return _pack(ids, "I")
    except OverflowError as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc


def unpack_ids(data: bytes | memoryview) -> list[int]:
    return _unpack(data, "I")


def ids_array(data: bytes | memoryview) -> array[int]:
    """Packed ids as an ``array("I")``: no int object per id until one is read."""
    ids = array("I")
    ids.frombytes(data)
    if not _LITTLE:
        ids.byteswap()
    return ids


def pack_floats(values: Iterable[float]) -> bytes:
    """Log-probs as little-endian float64: exact, so a round trip changes nothing."""
    return _pack(values, "d")


def unpack_floats(data: bytes) -> list[float]:
    return _unpack(data, "d")


class PackedIds(ListLikeIds):
    """Read-only token ids held as little-endian uint32 bytes.

    It reads like the list it stands for: length, indexing, iteration, equality with lists
    and views, ``+``, pickling and JSON (through ``json_default``) all give the ids. The
    bytes are immutable, so the codec may keep a reference to them between calls.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if len(data) % ID_WIDTH:
            raise ValueError(f"{len(data)} bytes are not a whole number of uint32 ids")
        self.data = bytes(data)  # the same object when it already is bytes

    @classmethod
    def of(cls, ids: Iterable[int]) -> PackedIds:
        """The ids packed (ValueError for an id outside uint32)."""
        return cls(pack_ids(ids))

    def __len__(self) -> int:
        return len(self.data) // ID_WIDTH

    def _at(self, index: int) -> int:
        return int.from_bytes(self.data[index * ID_WIDTH : (index + 1) * ID_WIDTH], "little")

    def _range(self, first: int, last: int) -> list[int]:
        return unpack_ids(memoryview(self.data)[first * ID_WIDTH : last * ID_WIDTH])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedIds):
            return self.data == other.data
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and self.tolist() == list(other)
        return NotImplemented

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy

        return numpy.frombuffer(self.data, dtype="<u4").astype(dtype or numpy.int64)

    def tolist(self) -> list[int]:
        return unpack_ids(self.data)

    def shared_blocks(self, parts: Sequence[bytes | memoryview], block_bytes: int) -> int:
        """How many whole blocks of ``block_bytes`` the ids share with the concatenation of
        ``parts`` (packed), from the start: whole parts by memcmp, then a binary search of
        memcmps within the first part that differs. A rollout's next prompt in text mode
        often re-renders the last reply differently (thinking dropped), and still shares
        every block before it."""
        at = 0
        for part in parts:
            if self.data.startswith(part, at):
                at += len(part)
                continue
            good, bad = at // block_bytes, (at + len(part)) // block_bytes + 1
            while bad - good > 1:  # blocks [0, good) are shared, [0, bad) are not
                middle = (good + bad) // 2
                if self.data.startswith(part[: middle * block_bytes - at], at):
                    good = middle
                else:
                    bad = middle
            return good
        return at // block_bytes
