"""Command-line subcommands, listed in `specwatch.cli.COMMANDS`.

A subcommand module holds ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args)``
(a command with actions sets ``func`` on each action's parser instead); the function
returns the process exit code, or raises `CommandError` to stop with one line. Modules
whose name starts with ``_`` hold what several commands share.
"""
