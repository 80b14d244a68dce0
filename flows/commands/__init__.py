"""Workflow subcommands of the ``dpmerge`` console script (``register(subparsers)`` each);
top-level imports stay light so ``dpmerge --help`` is fast (Prefect is imported in handlers)."""
