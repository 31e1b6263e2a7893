"""The start-up probe against vLLM started wrong (issue 23): each refusal names the fix.

Each case starts its own vLLM (about 45 s): the default raw log-probs, which the probe
refuses only where the trainer's temperature is not 1, and ``--skip-tokenizer-init``, which
leaves vLLM unable to answer a chat call at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from api.probe import EngineRefused, probe
from api.settings import ServerSettings
from tests.real_engines.conftest import running_vllm

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


async def test_raw_log_probs_are_refused_at_another_temperature(vllm_model: Path) -> None:
    cooler = {**PINNED, "temperature": 0.7}
    with running_vllm(vllm_model, "--logprobs-mode", "raw_logprobs") as url:
        with pytest.raises(EngineRefused, match="--logprobs-mode processed_logprobs"):
            await probe(ServerSettings(upstream=url, sampling_overrides=cooler))
        report = await probe(ServerSettings(upstream=url, sampling_overrides=PINNED))
    assert report.family == "vllm" and report.warnings == []


async def test_a_vllm_without_its_tokenizer_is_refused(vllm_model: Path) -> None:
    # Its parsers would need the tokenizer too: vLLM would not start with them.
    with running_vllm(vllm_model, "--skip-tokenizer-init", parsers=False) as url:
        with pytest.raises(EngineRefused, match="--skip-tokenizer-init"):
            await probe(ServerSettings(upstream=url, sampling_overrides=PINNED))
