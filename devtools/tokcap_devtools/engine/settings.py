"""Settings of one tokcap engine: what it serves, how it speaks, and what it gets wrong.

``wire`` is the engine whose HTTP format it speaks: ``vllm`` (vLLM 0.10.2's OpenAI server)
or ``sglang`` (SGLang 0.5.23's OpenAI routes and native ``/generate``).

The generation config holds the defaults applied when a request omits a sampling field,
as vLLM applies a model's ``generation_config.json`` (Qwen3's sets temperature 0.6, top_p
0.95, top_k 20); it can come from a YAML file with keys ``temperature``, ``top_p``,
``top_k`` and ``max_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .routing import MoeShape

GENERATION_KEYS = ("temperature", "top_p", "top_k", "max_tokens")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# Neutral sampling: what a request that omits a field gets without a generation config.
DEFAULT_GENERATION = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": None}
WIRES = ("vllm", "sglang")
QWEN3 = "qwen3"  # the --tokenizer name of Qwen3's vocabulary and template


@dataclass
class EngineSettings:
    model: str = "tokcap-engine"
    wire: str = "vllm"  # "vllm" | "sglang"
    # Required as "Authorization: Bearer <key>" where the wire's engine requires it.
    api_key: str | None = field(default=None, repr=False)
    policy: str = "scripted"  # "scripted" | "random"
    script_path: str | None = None  # None: tokcap_devtools/engine/assets/default_script.yaml
    seed: int = 0
    max_model_len: int = 131072
    # "qwen3" (Qwen3's vocabulary and chat template), a tokenizer.json (ChatML template), or
    # None: tokcap_devtools/engine/assets/tokenizer.json.
    tokenizer_path: str | None = None
    ground_truth_path: str | None = None  # JSONL, one line per generated sequence
    # Serve GET/DELETE /tokcap/ground_truth: every sampled id, to anyone who asks, so only
    # for tests and the demo (``--ground-truth``).
    ground_truth: bool = False
    # Knobs that emulate what real serving does to re-rendered history.
    noncanonical_rate: float = 0.0
    think_strip: bool = False  # ChatML only: Qwen3's own template decides what it drops
    json_reserialize: bool = False
    # False: answer like vLLM before 0.10.2 (no return_token_ids: no id fields at all), so a
    # client's /tokenize fallback can be tested against a real server.
    token_id_fields: bool = True
    # Log-probs of the distribution sampled from (after temperature, top-k, top-p) or of the
    # model before them, as vLLM's --logprobs-mode. Processed by default, unlike vLLM: the
    # tests compare captured log-probs with sampling at the harness's temperature.
    logprobs_mode: str = "processed_logprobs"
    generation_config: dict = field(default_factory=lambda: dict(DEFAULT_GENERATION))
    # What GET /version names (vLLM wire, ids on): from 0.12 every stream chunk carries its
    # ids, and a front end relays streams from it; an older one is told apart by this.
    vllm_version: str = "0.12.0"
    # Paced like a real engine under load (``tokcap_devtools.engine.pacing``): seconds to the first token,
    # then per token; 0 answers at once.
    first_token_s: float = 0.0
    token_s: float = 0.0
    # An MoE: whole replies carry every position's routed experts (vLLM's and SGLang's
    # --enable-return-routed-experts; ``tokcap_devtools.engine.routing``).
    moe: MoeShape | None = None
    # The weights' version at start (SGLang's --weight-version; "default" when unset there).
    weight_version: str = "default"

    def __post_init__(self) -> None:
        if self.wire not in WIRES:
            raise ValueError(f"wire must be 'vllm' or 'sglang', not {self.wire!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}")
        if self.policy not in ("scripted", "random"):
            raise ValueError(f"policy must be 'scripted' or 'random', not {self.policy!r}")
        if self.first_token_s < 0 or self.token_s < 0:
            raise ValueError("first_token_s and token_s must be >= 0")
        if not 0.0 <= self.noncanonical_rate <= 1.0:
            raise ValueError("noncanonical_rate must be within [0, 1]")
        if self.tokenizer_path not in (None, QWEN3) and not Path(self.tokenizer_path).is_file():
            raise ValueError(
                f"tokenizer must be 'qwen3' or a tokenizer.json file: {self.tokenizer_path}"
            )
        unknown = set(self.generation_config) - set(GENERATION_KEYS)
        if unknown:
            raise ValueError(f"unknown generation config keys {sorted(unknown)}")

    @property
    def knobs_off(self) -> bool:
        return not (self.noncanonical_rate or self.think_strip or self.json_reserialize)


def load_generation_config(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    config = dict(DEFAULT_GENERATION)
    config.update({k: data[k] for k in data})
    return config
