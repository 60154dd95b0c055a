"""Command-line subcommands; each module exposes ``register(subparsers)``.

A subcommand module adds its parser with ``set_defaults(func=...)``; ``func(args)``
returns the process exit code.
"""
