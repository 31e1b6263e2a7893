"""MoE routed experts read from an engine's reply and checked like the ids they align with.

With ``model_server.routed_experts`` on, every call must come back with its routes: one row
per position the model read (``capture.routes``), in the shape ``model_server.moe`` names
where it names one, each expert below its ``experts``. A reply without them, or with routes
that do not fit, is not captured: the call is lost and its rollout masked, never delivered
with routes missing for part of it.

A continued faithful call may ask for the rows after a stored prefix only (vLLM 0.32's
``routed_experts_prompt_start``, ``api.prompts.route_prefix``): they are then checked from
that position on.

Where each engine puts them (the adapter reads its own): vLLM 0.32 per choice,
``routed_experts``, a base64 ``.npy`` (server flag ``--enable-return-routed-experts``);
SGLang 0.5 in ``meta_info.routed_experts``, base64 of a flat int32 array (the same server
flag, and ``return_routed_experts`` on each request).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.engine.generation import Generation, with_changes
from capture.routes import Routes, routes_from_flat, routes_problem

NO_ROUTES = (
    "the engine returned no routed_experts although model_server.routed_experts is on "
    "(is it started with --enable-return-routed-experts?)"
)


def flat_routes(data: Any, moe: Any) -> Routes | None:
    """SGLang's flat routes shaped by ``model_server.moe`` (None when there are none)."""
    if data is None:
        return None
    if moe is None:
        raise ValueError("SGLang sends routes flat: model_server.moe must give layers and top_k")
    return routes_from_flat(data, moe.layers, moe.top_k)


def shape_problem(routes: Routes, moe: Any) -> str | None:
    """Why routes do not have the configured MoE shape, or None."""
    if moe is None or (routes.layers, routes.top_k) == (moe.layers, moe.top_k):
        return None
    return (
        f"routed_experts has {routes.layers} layers x {routes.top_k} experts a position, "
        f"model_server.moe says {moe.layers} x {moe.top_k}"
    )


def with_routes(
    generation: Generation, response: Mapping[str, Any], adapter: Any, moe: Any, start: int = 0
) -> Generation:
    """The generation with its checked routes, or voided with why they are unusable.

    ``start``: the engine was asked for the rows from that position on. An engine that
    ignored it (an older vLLM) sends every row; those are taken whole (``routes_start``
    0), as they would have been without asking."""
    if generation.ids_problem is not None:
        return generation
    try:
        routes = adapter.read_routes(response, moe)
    except ValueError as exc:
        return with_changes(generation, ids_problem=f"routed_experts unusable: {exc}")
    if routes is None:
        return with_changes(generation, ids_problem=NO_ROUTES)
    prompt = generation.prompt_token_ids or []
    generated = generation.generation_token_ids or []
    experts = moe.experts if moe is not None else None
    if start and routes.rows == len(prompt) + len(generated) - 1:
        start = 0  # every row came: the engine does not know the field
    problem = shape_problem(routes, moe) or routes_problem(
        routes, len(prompt), len(generated), experts, start
    )
    if problem is not None:
        return with_changes(generation, ids_problem=problem)
    return with_changes(generation, routed_experts=routes, routes_start=start)
