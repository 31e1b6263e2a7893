"""``tokcap engine``: run the tokcap engine (also ``python -m tokcap_devtools.engine.cli``)."""

from __future__ import annotations

import argparse
import os
import sys

from tokcap import verb_main

from .routing import MoeShape
from .settings import LOGPROBS_MODES, WIRES, EngineSettings, load_generation_config

API_KEY_ENV = "TOKCAP_ENGINE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _wire_arguments(parser)
    _model_arguments(parser)
    _server_arguments(parser)


def _wire_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine speaks: whose format, behind which key, with which ids and log-probs."""
    parser.add_argument(
        "--wire",
        choices=list(WIRES),
        default="vllm",
        help="whose HTTP format to speak: vLLM 0.10.2's or SGLang 0.5.23's (default: vllm)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' where the engine of --wire does "
        f"(default: ${API_KEY_ENV} if set, else no key)",
    )
    parser.add_argument(
        "--logprobs-mode",
        choices=list(LOGPROBS_MODES),
        default="processed_logprobs",
        help="log-probs after temperature/top-k/top-p (processed) or before them (raw); "
        "default: processed_logprobs (vLLM's default is raw_logprobs)",
    )
    parser.add_argument(
        "--without-token-ids",
        action="store_true",
        help="answer like vLLM < 0.10.2 (SGLang < 0.5.17 with --wire sglang): no id fields "
        "(default: off)",
    )


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """What the engine serves and how it answers, and the knobs that make it lossy."""
    parser.add_argument(
        "--model", default="tokcap-engine", help="served model name (default %(default)s)"
    )
    parser.add_argument(
        "--policy",
        choices=["scripted", "random"],
        default="scripted",
        help="scripted: answers from --script (or the built-in script); random: random tokens "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--script",
        default=None,
        help="YAML script for the scripted policy (default: the built-in script)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the sampler (default %(default)s)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=131072,
        help="context window reported at /v1/models (default %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="qwen3|PATH",
        help="qwen3: the real Qwen3 vocabulary, with prompts rendered by Qwen3's chat template "
        "(the renderers package); or a tokenizer.json, with the ChatML template "
        "(default: the shipped byte-level BPE)",
    )
    parser.add_argument(
        "--ground-truth",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="serve every sampled sequence at GET/DELETE /tokcap/ground_truth (for tests and "
        "the demo) and, with PATH, append each to that JSONL file (default: off)",
    )
    parser.add_argument(
        "--generation-config",
        default=None,
        help="YAML with default temperature, top_p, top_k, max_tokens (default: none)",
    )
    parser.add_argument(
        "--noncanonical-rate",
        type=float,
        default=0.0,
        help="per-token chance of a non-canonical two-token segmentation (default %(default)s)",
    )
    parser.add_argument(
        "--think-strip",
        action="store_true",
        help="the ChatML template drops past <think> blocks; ignored with --tokenizer qwen3, "
        "whose template already drops the thinking of turns before the last user query "
        "(default: off)",
    )
    parser.add_argument(
        "--first-token-s",
        type=float,
        default=0.0,
        help="seconds before the first token, as a loaded engine queues and prefills "
        "(default %(default)s: at once)",
    )
    parser.add_argument(
        "--token-s",
        type=float,
        default=0.0,
        help="seconds per generated token after the first (default %(default)s)",
    )
    parser.add_argument(
        "--routed-experts",
        metavar="LAYERSxTOP_KxEXPERTS",
        type=MoeShape.parse,
        default=None,
        help="serve as an MoE that returns every position's routed experts with whole "
        "replies, like vLLM's --enable-return-routed-experts (e.g. 48x8x128; default: off)",
    )
    parser.add_argument(
        "--json-reserialize",
        action="store_true",
        help="tool-call JSON is generated compact, re-rendered with spaces (default: off)",
    )


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8001, help="port to bind (default %(default)s)")
    parser.add_argument(
        "--log-level", default="warning", help="uvicorn log level (default %(default)s)"
    )
    parser.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="event loop (default auto: uvloop)",
    )
    parser.add_argument(
        "--http",
        choices=["auto", "h11", "httptools"],
        default="auto",
        help="HTTP/1.1 parser (default auto: httptools)",
    )


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    settings = EngineSettings(
        model=args.model,
        wire=args.wire,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        policy=args.policy,
        script_path=args.script,
        seed=args.seed,
        max_model_len=args.max_model_len,
        tokenizer_path=args.tokenizer,
        ground_truth=args.ground_truth is not None,
        ground_truth_path=args.ground_truth if isinstance(args.ground_truth, str) else None,
        noncanonical_rate=args.noncanonical_rate,
        think_strip=args.think_strip,
        json_reserialize=args.json_reserialize,
        token_id_fields=not args.without_token_ids,
        logprobs_mode=args.logprobs_mode,
        first_token_s=args.first_token_s,
        token_s=args.token_s,
        moe=args.routed_experts,
    )
    if args.generation_config:
        settings.generation_config = load_generation_config(args.generation_config)
        settings.__post_init__()
    return settings


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .server import create_app

    try:
        settings = settings_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"tokcap engine: {exc}", file=sys.stderr)
        return 2
    # Quiet by default (log level warning), so say once where to point a front end.
    print(
        f"tokcap engine: http://{args.host}:{args.port} ({args.wire} wire, model "
        f"{settings.model}, {args.policy} policy)",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        loop=args.loop,
        http=args.http,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return verb_main("tokcap engine", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
