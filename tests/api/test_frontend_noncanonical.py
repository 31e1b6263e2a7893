"""Non-canonical sampling: what the rebuilt chain does when re-rendered history differs.

With ``noncanonical_rate > 0`` the engine sometimes samples a segmentation the tokenizer
would not produce; when the harness re-sends that text, the next prompt re-tokenizes it
differently, so the next call's prompt does not extend the previous call's ids. The capture
still holds exactly what was sampled, and the rebuild must report the split (more than one
chain, a delivered fraction below one, or a mask), never deliver a sequence the policy did
not see.
"""

from __future__ import annotations

from pathlib import Path

import anthropic

from tests.support.frontend import (
    answer_output,
    assert_entries_equal_ground_truth,
    both_servers,
    finalize,
    freeze,
    sdk_tool_loop,
)

PROMPT = "run echo hello and then tell me about the working directory in some detail"


def test_noncanonical_ids_split_the_chain_and_it_is_reported(tmp_path: Path) -> None:
    rollout_id = "noncanonical-1"
    engine = {"noncanonical_rate": 0.5, "seed": 7}
    with both_servers(tmp_path, engine=engine) as servers:
        sdk = anthropic.Anthropic(base_url=servers.base(rollout_id), api_key="dummy", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        _, reply = sdk_tool_loop(sdk, messages)
        truth = servers.ground_truth()
    snapshot = freeze(tmp_path, rollout_id)
    # The capture is exact: every entry is what the engine sampled.
    assert_entries_equal_ground_truth(snapshot, truth)
    calls = len(snapshot.entries)
    assert calls == 3
    # At least one later prompt does not extend its predecessor's sampled ids.
    by_length = sorted(snapshot.entries, key=lambda e: len(e.prompt_token_ids))
    assert any(
        later.prompt_token_ids[: len(earlier.full_sequence)] != earlier.full_sequence
        for earlier, later in zip(by_length, by_length[1:], strict=False)
    )
    record, build = finalize(tmp_path, rollout_id, answer_output(reply.content[-1].text))
    metrics = build.metrics
    assert metrics["n_calls"] == calls
    # Reported, never silently merged: split chains, a partial delivery, or a mask.
    assert metrics["chains"] > 1 or build.masked
    assert build.masked or metrics["delivered_fraction"] < 1.0
    if not build.masked:
        sampled = {tuple(r["token_ids"]) for r in truth}
        carriers = [i for i in record["response"]["output"] if "generation_token_ids" in i]
        assert carriers and len(carriers) < calls
        for item in carriers:
            assert tuple(item["generation_token_ids"]) in sampled
