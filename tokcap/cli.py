"""The ``tokcap`` command: one subcommand per verb, each a module of ``tokcap.commands``
(``tokcap engine``: the development engine's own ``tokcap_devtools.engine.cli``).

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``; this file
only wires them, so adding a command never touches the others. Every option's help ends with
its default (``DefaultsHelpFormatter``), so a help text written without one still says it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tokcap.help import DefaultsHelpFormatter

SUBCOMMANDS = {
    "serve": ("tokcap.commands.serve", "run the model-server front end that captures token ids"),
    "engine": (
        "tokcap_devtools.engine.cli",
        "run the tokcap engine, a vLLM-compatible test engine",
    ),
    "worker": ("tokcap.commands.worker", "run a pool of rebuild workers on the Redis job stream"),
    "submit": ("tokcap.commands.submit", "submit a finished rollout record for rebuilding"),
    "inspect": ("tokcap.commands.inspect", "show what is captured for one rollout"),
    "report": ("tokcap.commands.report", "summarize rebuilt records step by step: what to watch"),
    "demo": (
        "tokcap_devtools.demo",
        "run the whole pipeline on scripted rollouts, print the result, write the report",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokcap",
        description="Exact training token ids for agent harnesses (capture, rebuild, deliver).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(
            name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter
        )
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            sub.set_defaults(_missing=module_name)
            continue
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "_missing", None):
        print(
            f"tokcap {args.command}: not available in this build ({args._missing}; "
            "it comes with tokcap-devtools)",
            file=sys.stderr,
        )
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
