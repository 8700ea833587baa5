"""bdnctl's commands, one module per group (snapshots, node, verify, fleet).

Each module's ``add_<command>(sub, common)`` adds one subcommand to the parser and sets its
``run(client, args) -> exit code``; :mod:`bdn.cli.bdnctl` lists them in ``--help`` order and maps
errors to exit codes.
"""
