"""Command-line subcommands; each module exposes ``register(subparsers)``.

A subcommand module adds its parser with ``set_defaults(func=...)``; ``func(args)``
returns the process exit code, or raises `CommandError` to stop with one line. Modules
whose name starts with ``_`` hold what several commands share.
"""
