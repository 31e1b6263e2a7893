"""What the codec's read-only id sequences share: each reads as the list it stands for."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload


class ListLikeIds(Sequence[int]):
    """The base of ``IdView`` and ``PackedIds``: indexing, iteration, repr, copies, pickles
    and ``+`` go through ``_at``, ``_range`` and ``tolist``, so neither can drift from
    reading like a list."""

    __slots__ = ()

    def tolist(self) -> list[int]:
        raise NotImplementedError

    def _at(self, index: int) -> int:
        """The id at ``index``, already checked to be within ``[0, len)``."""
        raise NotImplementedError

    def _range(self, first: int, last: int) -> list[int]:
        """The ids ``[first:last]`` as a list, ``0 <= first <= last <= len``."""
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        size = len(self)
        if isinstance(index, slice):
            first, last, step = index.indices(size)
            if step == 1:
                return self._range(first, max(first, last))
            return self.tolist()[index]
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"{type(self).__name__} index out of range")
        return self._at(index)

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which do not hash

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy or a pickle carries its own ids as a list, not what the ids are kept in.
        return (list, (self.tolist(),))

    def __add__(self, other: Sequence[int]) -> list[int]:
        # ``prompt + generation`` reads as it does on lists: a new list.
        return [*self.tolist(), *other]

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return [*other, *self.tolist()]
