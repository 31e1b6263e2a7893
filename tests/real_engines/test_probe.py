"""The start-up probe against engines started wrong (issue 23): each refusal names the fix.

Each case starts its own engine (about 45 s): a vLLM with a key and the default raw
log-probs (which the probe refuses only where the trainer's temperature is not 1), a vLLM
with ``--skip-tokenizer-init``, which leaves it unable to answer a chat call at all, and an
SGLang with a key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from api.engine.probe import EngineRefused
from api.settings import ServerSettings
from api.startup import probe
from tests.real_engines.conftest import build_model, ensure_sglang, running_sglang, running_vllm

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


async def test_a_key_and_raw_log_probs_are_each_refused_with_their_fix(vllm_model: Path) -> None:
    """One vLLM started with ``--api-key`` and its default raw log-probs: without the key the
    probe names ``upstream_api_key`` (and never the key); with it, raw log-probs are refused
    where the trainer samples at another temperature than 1, and accepted at 1."""
    key = "sekrit-vllm-key"
    cooler = {**PINNED, "temperature": 0.7}
    with running_vllm(vllm_model, "--logprobs-mode", "raw_logprobs", "--api-key", key) as url:
        with pytest.raises(EngineRefused, match="upstream_api_key") as keyless:
            await probe(ServerSettings(upstream=url, sampling_overrides=PINNED))
        keyed = {"upstream": url, "upstream_api_key": key}
        with pytest.raises(EngineRefused, match="--logprobs-mode processed_logprobs") as raw:
            await probe(ServerSettings(**keyed, sampling_overrides=cooler))
        report = await probe(ServerSettings(**keyed, sampling_overrides=PINNED))
    assert report.family == "vllm" and report.warnings == []
    assert key not in str(keyless.value) and key not in str(raw.value)


async def test_a_vllm_without_its_tokenizer_is_refused(vllm_model: Path) -> None:
    # Its parsers would need the tokenizer too: vLLM would not start with them.
    with running_vllm(vllm_model, "--skip-tokenizer-init", parsers=False) as url:
        with pytest.raises(EngineRefused, match="--skip-tokenizer-init"):
            await probe(ServerSettings(upstream=url, sampling_overrides=PINNED))


async def test_an_sglang_with_a_key_is_refused_without_it_and_accepted_with_it() -> None:
    key = "sekrit-sglang-key"
    with running_sglang(build_model(ensure_sglang()), "--api-key", key) as url:
        with pytest.raises(EngineRefused, match="upstream_api_key") as keyless:
            await probe(ServerSettings(upstream=url, sampling_overrides=PINNED))
        keyed = ServerSettings(upstream=url, upstream_api_key=key, sampling_overrides=PINNED)
        report = await probe(keyed)
    assert report.family == "sglang" and report.warnings == []
    assert key not in str(keyless.value)
