"""Subcommands of the ``zeppelin`` command line.

Each module (or ``module:object``) named in ``megatron_zeppelin.cli.COMMANDS`` exposes
``add_arguments(parser)`` and ``run(args) -> int``; the CLI imports only the one that runs, so
a light command never pays for a heavy one's imports.
"""
