"""MoE routed experts of one call: which experts each layer routed each position to.

Engines return them for every position the model read (prompt and generation, all but the
last sampled token, which no forward pass has seen yet): ``[positions, layers, top_k]``
expert indices. tokcap keeps them as little-endian uint16 bytes (every engine's width fits:
vLLM sends uint8 or uint16, SGLang int32 of values below the expert count) held in parts,
so a decoded rollout's calls share their common prefix's bytes instead of copying them.

On the wire (a rebuilt record, the results stream) they are one object a trainer turns
into an array in one call::

    {"encoding": "base64", "dtype": "uint16", "shape": [n, layers, top_k], "data": "..."}
    numpy.frombuffer(base64.b64decode(r["data"]), r["dtype"]).reshape(r["shape"])
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy

ROUTE_DTYPE = "<u2"
WIRE_DTYPE = "uint16"
ITEM_BYTES = 2
MAX_EXPERT = 2**16 - 1


class RouteChain(NamedTuple):
    """The names of the blocks a call's ``rows`` routes are stored in, first block first,
    cut at ``block_size`` rows (``capture.codec.route_blocks``): what the next call of the
    rollout names to reuse a whole-block prefix of them without hashing it again."""

    names: tuple[str, ...]
    block_size: int
    rows: int

    @property
    def whole_blocks(self) -> int:
        """The blocks a prefix may end at: all but a last partial one."""
        return min(len(self.names), self.rows // self.block_size)


class Routes:
    """The routes of ``rows`` positions, ``layers`` x ``top_k`` uint16 experts each.

    ``chain``, where known, names the blocks they are stored in: routes read from a store
    carry it, and so do routes the front end cut itself (``route_blocks.ChainedRoutes``).
    """

    __slots__ = ("parts", "rows", "layers", "top_k", "chain")

    def __init__(
        self,
        parts: Sequence[bytes],
        rows: int,
        layers: int,
        top_k: int,
        chain: RouteChain | None = None,
    ) -> None:
        if layers < 1 or top_k < 1 or rows < 0:
            raise ValueError(f"routes shape [{rows}, {layers}, {top_k}] is not valid")
        self.parts = tuple(parts)
        self.rows, self.layers, self.top_k = rows, layers, top_k
        self.chain = chain
        held = sum(len(part) for part in self.parts)
        if held < rows * self.row_bytes:
            raise ValueError(f"routes hold {held} bytes, fewer than {rows} rows need")

    @property
    def row_bytes(self) -> int:
        return self.layers * self.top_k * ITEM_BYTES

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.layers, self.top_k)

    def to_bytes(self) -> bytes:
        """The rows' bytes, row-major, joined once."""
        size = self.rows * self.row_bytes
        if len(self.parts) == 1 and len(self.parts[0]) == size:
            return bytes(self.parts[0])
        return b"".join(self.parts)[:size]

    def to_numpy(self) -> numpy.ndarray:
        """A read-only ``[rows, layers, top_k]`` uint16 array."""
        return numpy.frombuffer(self.to_bytes(), ROUTE_DTYPE).reshape(self.shape)

    def wire(self) -> dict[str, Any]:
        """The compact JSON form (module docstring)."""
        data = base64.b64encode(self.to_bytes()).decode("ascii")
        return {"encoding": "base64", "dtype": WIRE_DTYPE, "shape": list(self.shape), "data": data}

    def packed(self) -> dict[str, Any]:
        """The binary form for msgpack (the results stream): shape and raw bytes."""
        return {"dtype": WIRE_DTYPE, "shape": list(self.shape), "bytes": self.to_bytes()}

    @classmethod
    def from_packed(cls, value: Mapping[str, Any], before: Routes | None = None) -> Routes:
        """``packed`` read back; with ``before``, the rows continue those routes (whose
        parts are shared, not copied)."""
        rows, layers, top_k = (int(n) for n in value["shape"])
        data = bytes(value["bytes"])
        if before is None:
            return cls((data,), rows, layers, top_k)
        if (before.layers, before.top_k) != (layers, top_k):
            raise ValueError("routes continue routes of another shape")
        return cls((*before.span(0, before.rows), data), before.rows + rows, layers, top_k)

    def span(self, start: int, stop: int) -> list[bytes]:
        """The parts holding rows ``start`` to ``stop``, sliced only at the two ends."""
        begin, end = start * self.row_bytes, stop * self.row_bytes
        parts: list[bytes] = []
        at = 0
        for part in self.parts:
            low, high = max(begin - at, 0), min(end - at, len(part))
            if low < high:
                parts.append(part if (low, high) == (0, len(part)) else part[low:high])
            at += len(part)
            if at >= end:
                break
        return parts

    def shared_rows(self, before: Routes) -> int:
        """``before.rows`` when these routes start with all of ``before``'s rows, else 0.

        Routes decoded from one rollout's blocks share those blocks' bytes, so the parts
        both hold are proven equal by identity; only the rest is compared."""
        if before.shape[1:] != self.shape[1:] or before.rows > self.rows:
            return 0
        size = before.rows * self.row_bytes
        done = 0
        for mine, theirs in zip(self.parts, before.parts, strict=False):
            if mine is not theirs or done + len(mine) > size:
                break
            done += len(mine)
        if done >= size:
            return before.rows
        start = done // self.row_bytes
        mine = b"".join(self.span(start, before.rows))
        return before.rows if mine == b"".join(before.span(start, before.rows)) else 0

    def rows_from(self, start: int) -> Routes:
        """The routes of rows ``start`` on, sharing the parts that hold them."""
        return Routes(self.span(start, self.rows), self.rows - start, self.layers, self.top_k)

    def max_expert(self) -> int:
        return int(self.to_numpy().max()) if self.rows else -1

    def __eq__(self, other: object) -> bool:
        """Equal to routes, or to any array or wire object of the same experts."""
        if not isinstance(other, Routes):
            try:
                other = Routes.coerce(other)
            except (ValueError, TypeError):
                return NotImplemented
        return self.shape == other.shape and self.to_bytes() == other.to_bytes()

    __hash__ = None  # equal to arrays and wire objects, which hash otherwise (or not at all)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (and deep-copied) as its rows' bytes: its parts may be views of a
        decoded snapshot's blocks, which do not pickle."""
        return (Routes, ((self.to_bytes(),), self.rows, self.layers, self.top_k))

    def __repr__(self) -> str:
        return f"Routes(shape={list(self.shape)})"

    @classmethod
    def from_array(cls, array: Any) -> Routes:
        """From anything numpy reads as a 3-D array of non-negative integers."""
        values = numpy.asarray(array)
        if values.ndim != 3:
            raise ValueError(f"routes must be [positions, layers, top_k], got {values.ndim}-D")
        if values.size and values.dtype.kind not in "iu":
            raise ValueError(f"routes must be integers, got {values.dtype}")
        if values.size and (values.min() < 0 or values.max() > MAX_EXPERT):
            raise ValueError(f"expert indices must be in [0, {MAX_EXPERT}]")
        rows, layers, top_k = values.shape
        data = numpy.ascontiguousarray(values, dtype=ROUTE_DTYPE).tobytes()
        return cls((data,), rows, layers, top_k)

    @classmethod
    def coerce(cls, value: Any) -> Routes:
        """Routes from their wire object, an ``.npy`` or raw base64 with a shape, or lists."""
        if isinstance(value, Routes):
            return value
        if isinstance(value, Mapping):
            return cls.from_wire(value)
        return cls.from_array(value)

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> Routes:
        shape = value.get("shape")
        if not (isinstance(shape, list) and len(shape) == 3):
            raise ValueError("routes need a shape [positions, layers, top_k]")
        raw = decode_base64(value.get("data"))
        dtype = numpy.dtype(str(value.get("dtype") or WIRE_DTYPE)).newbyteorder("<")
        if len(raw) != int(numpy.prod(shape)) * dtype.itemsize:
            raise ValueError(f"routes data has {len(raw)} bytes, not what shape {shape} needs")
        return cls.from_array(numpy.frombuffer(raw, dtype).reshape(shape))


def as_routes(value: Any) -> Routes | None:
    """Routes, or their wire object read back from JSON; None for any other form."""
    if isinstance(value, Routes):
        return value
    if isinstance(value, Mapping) and value.get("encoding") == "base64":
        try:
            return Routes.from_wire(value)
        except (ValueError, TypeError):
            return None
    return None


def routes_differ(routes: Iterable[Any]) -> int:
    """How many of a chain's routes are not a prefix of its last call's."""
    found = [found for found in map(as_routes, routes) if found is not None]
    if len(found) < 2:
        return 0
    last = found[-1]
    return sum(1 for value in found[:-1] if last.shared_rows(value) != value.rows)


def decode_base64(data: Any) -> bytes:
    if not isinstance(data, str):
        raise ValueError("routes data must be a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError as exc:
        raise ValueError(f"routes data is not base64: {exc}") from None


def routes_from_npy(data: str) -> Routes:
    """vLLM's form (0.32, ``choices[i].routed_experts``): a base64 ``.npy`` file."""
    raw = decode_base64(data)
    try:
        array = numpy.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - numpy raises EOFError, BadZipFile, MemoryError...
        raise ValueError(f"routed_experts is not a .npy array ({type(exc).__name__})") from None
    if not isinstance(array, numpy.ndarray):
        raise ValueError("routed_experts is not a .npy array")
    return Routes.from_array(array)


def routes_from_flat(data: str, layers: int, top_k: int, dtype: str = "<i4") -> Routes:
    """SGLang's form (0.5, ``meta_info.routed_experts``): base64 of a flat int32 array."""
    flat = numpy.frombuffer(decode_base64(data), dtype)
    if layers < 1 or top_k < 1 or flat.size % (layers * top_k):
        raise ValueError(f"{flat.size} expert indices do not fill rows of {layers} x {top_k}")
    return Routes.from_array(flat.reshape(-1, layers, top_k))


def routes_problem(
    routes: Routes,
    prompt_len: int,
    generated: int,
    num_experts: int | None = None,
    start: int = 0,
) -> str | None:
    """Why ``routes`` cannot be this call's, or None: one row per position the model read
    (the prompt and every sampled token but the last) from ``start`` on (the engine was
    asked to leave out the positions before it), experts below ``num_experts``."""
    expected = max(prompt_len + generated - 1 - start, 0)
    if routes.rows != expected:
        after = f" from position {start}" if start else ""
        return (
            f"routed_experts has {routes.rows} rows for {prompt_len} prompt and "
            f"{generated} generated tokens{after} (expected {expected})"
        )
    largest = routes.max_expert() if num_experts is not None else -1
    if num_experts is not None and largest >= num_experts:
        return f"routed_experts names expert {largest} of {num_experts}"
    return None
