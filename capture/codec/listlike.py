"""What the codec's read-only id sequences share: each reads as the list it stands for."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class ListLikeIds(Sequence[int]):
    """The base of ``IdView`` and ``PackedIds``: iteration, repr, copies, pickles and ``+``
    all go through ``tolist``, so neither can drift from reading like a list."""

    __slots__ = ()

    def tolist(self) -> list[int]:
        raise NotImplementedError

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
