"""Read-only views of one shared id sequence: how a decoded snapshot hands out its prompts.

Every call of a chain re-sends the history, so a snapshot's prompts are prefixes of one
sequence. The codec assembles that sequence once per chain and gives each entry an
``IdView`` of its range instead of a list of its own: a 1,000-turn rollout would otherwise
hold every prompt again (about 250 M list slots). A view compares equal to a list with the
same ids, slices to a list, and says by identity (``same_range_as``, ``shares_prefix``)
what a list comparison would spend a pass over the prompt to learn.

The sequence is a list, or (as the codec assembles it) an ``array("I")``: 4 bytes an id,
no int object per id, nothing for the garbage collector to walk; ids become ints only
when read. It is only ever appended to past the end of every view over it, so a view's
ids never change.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from capture.codec.listlike import ListLikeIds
from capture.codec.packed import PackedIds
from capture.routes import Routes


class IdView(ListLikeIds):
    """The ids ``base[start:stop]`` of a shared list or array, without copying them."""

    __slots__ = ("base", "start", "stop")

    def __init__(self, base: list[int] | array[int], start: int, stop: int) -> None:
        if not 0 <= start <= stop <= len(base):
            raise ValueError(f"view [{start}:{stop}] is outside a list of {len(base)} ids")
        self.base = base
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def _at(self, index: int) -> int:
        return self.base[self.start + index]

    def _range(self, first: int, last: int) -> list[int]:
        return _listed(self.base[self.start + first : self.start + last])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdView):
            if self.same_range_as(other):
                return True
            return len(self) == len(other) and self.tolist() == other.tolist()
        if isinstance(other, list):
            return len(self) == len(other) and self.tolist() == other
        return NotImplemented

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        # numpy would otherwise read a view one __getitem__ at a time.
        import numpy

        part = self.base[self.start : self.stop]  # a copy: the base may still grow
        if isinstance(part, array):
            return numpy.frombuffer(part, dtype=numpy.uint32).astype(dtype or numpy.int64)
        return numpy.asarray(part, dtype=dtype)

    def key(self) -> bytes | tuple[int, ...]:
        """The ids as a hashable key: over an array, its bytes (one C copy, nothing for the
        garbage collector to walk), else a tuple."""
        part = self.base[self.start : self.stop]
        return part.tobytes() if isinstance(part, array) else tuple(part)

    def tolist(self) -> list[int]:
        """The ids as a new list (one copy of this range only)."""
        return _listed(self.base[self.start : self.stop])

    def same_range_as(self, other: IdView) -> bool:
        return self.base is other.base and self.start == other.start and self.stop == other.stop

    def continued_by(self, other: IdView) -> bool:
        """Whether ``other`` is the range right after this one in the same list."""
        return self.base is other.base and self.stop == other.start


def _listed(part: list[int] | array[int]) -> list[int]:
    return part if isinstance(part, list) else part.tolist()


def json_default(value: Any) -> Any:
    """``default=`` for ``json.dumps``, orjson and ``msgpack.packb``: a rebuilt record's
    token arrays may be views (or an entry's prompt packed ids), which serializers do not
    know; each is written as its list, and routed experts as their compact wire object."""
    if isinstance(value, (IdView, PackedIds)):
        return value.tolist()
    if isinstance(value, Routes):
        return value.wire()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def as_list(ids: Sequence[int]) -> list[int]:
    """A list for a record (JSON, msgpack): a view's range copied, a list as it is."""
    if isinstance(ids, (IdView, PackedIds)):
        return ids.tolist()
    return ids  # type: ignore[return-value]


def shares_prefix(prompt: Sequence[int], before: Sequence[int], after: Sequence[int]) -> bool:
    """True when ``prompt`` provably starts with ``before`` + ``after`` by identity: all three
    are views of one list, ``before`` starts where ``prompt`` does and ``after`` follows it.
    False means only "not known", never "different"."""
    return (
        isinstance(prompt, IdView)
        and isinstance(before, IdView)
        and isinstance(after, IdView)
        and prompt.base is before.base
        and before.continued_by(after)
        and prompt.start == before.start
        and after.stop <= prompt.stop
    )
