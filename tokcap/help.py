"""How every ``tokcap`` verb shows its options, and the entry point each verb's module shares.

Each verb's module can also run alone (``python -m tokcap.commands.worker``); ``verb_main``
builds that parser the way ``tokcap <verb>`` builds its subparser, so both help texts say
every option's default (``DefaultsHelpFormatter``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, minus its repetitions and its ``None``.

    A help text that already names its default is left alone; a flag's default is "off";
    an option without a default says "none". A default is the option's own value, never
    an environment variable's: help texts name the variable (values may be secrets).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:  # a flag: store_true and the like
            return f"{text} (default: off)" if action.default is False else text
        value = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {value})"


def verb_main(
    prog: str,
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """Parse ``argv`` with the verb's own arguments and run it (a module's ``main``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=DefaultsHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
