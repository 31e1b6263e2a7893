"""The ``tokcap`` verbs, one module each: ``add_arguments(parser)`` and ``run(args) -> int``,
thin adapters over the packages that do the work (``api``, ``transports``, ``capture``,
``tokcap.report``). ``tokcap engine`` is the development engine's own (``tokcap_devtools.engine.cli``).
"""
