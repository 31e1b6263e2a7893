"""The engine as an MoE model: which experts each layer routes each position to.

A real MoE routes a position from the positions before it, so its routes for a prefix do
not change when the prefix is extended. The engine's routes are a deterministic function
of the same thing: a running hash of the ids up to the position, mixed with the layer.
Tests recompute them from the ground-truth ids with ``routes_of``.

Routes cover every position the model read: the prompt and every sampled token but the
last, ``[len(ids) - 1, layers, top_k]``, as vLLM's and SGLang's do.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy

_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)$")
_MIX = numpy.uint64(0x9E3779B97F4A7C15)
_LAYER = numpy.uint64(0xBF58476D1CE4E5B9)


@dataclass(frozen=True)
class MoeShape:
    """``layers`` MoE layers, each routing a position to ``top_k`` of ``experts``."""

    layers: int
    top_k: int
    experts: int

    @classmethod
    def parse(cls, spec: str) -> MoeShape:
        """``"LAYERSxTOP_KxEXPERTS"``, as ``--routed-experts 48x8x128``."""
        match = _SPEC.match(spec.strip())
        if not match:
            raise ValueError(f"routed experts must be LAYERSxTOP_KxEXPERTS, not {spec!r}")
        shape = cls(*(int(part) for part in match.groups()))
        if min(shape.layers, shape.top_k) < 1 or not shape.top_k <= shape.experts <= 65536:
            raise ValueError(
                f"routed experts {spec!r}: need layers, top_k >= 1, top_k <= experts <= 65536"
            )
        return shape


def routes_of(ids: Sequence[int], shape: MoeShape) -> numpy.ndarray:
    """The routes of every position but the last: uint16 ``[len(ids) - 1, layers, top_k]``."""
    values = numpy.asarray(ids[:-1] if len(ids) else [], dtype=numpy.uint64)
    with numpy.errstate(over="ignore"):
        positions = numpy.arange(1, len(values) + 1, dtype=numpy.uint64)
        running = numpy.cumsum((values + numpy.uint64(1)) * positions * _MIX)
        layers = numpy.arange(shape.layers, dtype=numpy.uint64) * _LAYER
        mixed = (running[:, None] ^ layers[None, :]) * _MIX
    start = (mixed >> numpy.uint64(33)) % numpy.uint64(shape.experts)
    offsets = numpy.arange(shape.top_k, dtype=numpy.uint64)
    experts = (start[:, :, None] + offsets[None, None, :]) % numpy.uint64(shape.experts)
    return experts.astype(numpy.uint16)


def vllm_routes(routes: numpy.ndarray, shape: MoeShape) -> str:
    """vLLM's form: a base64 ``.npy``, uint8 when the experts fit, else uint16."""
    dtype = numpy.uint8 if shape.experts <= 256 else numpy.uint16
    buffer = io.BytesIO()
    numpy.save(buffer, routes.astype(dtype), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sglang_routes(routes: numpy.ndarray) -> str:
    """SGLang's form: base64 of the flat int32 array."""
    return base64.b64encode(routes.astype("<i4").tobytes()).decode("ascii")
