"""``dramatiq-pg-outbox``: the operators' command line (see :mod:`.main` for the subcommands).

Layout: :mod:`.main` builds the parser and runs a subcommand; :mod:`.common` holds what every
subcommand shares (errors and exit codes, the database URL and connection, tables);
:mod:`.commands` the subcommands on the broker's tables; :mod:`.dashboard` and
:mod:`.periodic` the ``dashboard``, ``scheduler`` and ``schedules`` subcommands.  The rest of
the package never imports this one.
"""

from __future__ import annotations

from .._launch import interruptible_imports

# A Ctrl-C while the subcommands import is one line and exit code 130, as later on.
with interruptible_imports():
    from .main import main

__all__ = ["main"]
