"""The ``tokcap`` command (``tokcap.cli``), its verbs (``tokcap.commands``) and the report's
parts (``tokcap.report``). ``verb_main`` and ``DefaultsHelpFormatter`` are public: a tool that
adds its own verb, such as the development engine, runs it the way the others run.
"""

from tokcap.help import DefaultsHelpFormatter, verb_main

__all__ = ["DefaultsHelpFormatter", "verb_main"]
