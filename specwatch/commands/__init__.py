"""Command-line subcommands, listed in `specwatch.cli.COMMANDS`: each module holds ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args)`` (or sets ``func`` per action); ``_`` modules are shared.
"""
