"""The first moments of the ``dramatiq-pg-outbox`` command: Ctrl-C while it is still importing.

The command's entry point (``dramatiq_pg_outbox.cli:main``, or ``python -m
dramatiq_pg_outbox.cli``) runs only once the package and what it needs (psycopg,
SQLAlchemy, Dramatiq...) are imported, which takes a noticeable moment.  A Ctrl-C in
that moment would print Python's traceback of the import under way; the package's
imports run inside :func:`interruptible_imports`, which turns it into the command's
one line and exit code 130, as a Ctrl-C later does.  In any other program (an
application importing the package) the interruption is raised unchanged.

This module imports only the standard library, so it is there before anything else.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: Name of the command in its messages.
PROG = "dramatiq-pg-outbox"
#: Exit code after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
#: What ``python -m`` runs the command as.
_MODULES = ("dramatiq_pg_outbox.cli", "dramatiq_pg_outbox.cli.__main__")


def launched_as_command() -> bool:
    """Whether this process is the ``dramatiq-pg-outbox`` command.

    Returns:
      bool: True for the console script (its ``__main__`` file is named
      ``dramatiq-pg-outbox``) and for ``python -m dramatiq_pg_outbox.cli``; False
      for any other program.
    """
    main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    name = os.path.basename(main_file).removesuffix(".exe").removesuffix("-script.py")
    if name == PROG:
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any(arg == "-m" and module in _MODULES for arg, module in itertools.pairwise(argv))


@contextmanager
def interruptible_imports() -> Iterator[None]:
    """Run a block of imports; in the command, a Ctrl-C there prints one line and exits 130.

    Raises:
      SystemExit: With code 130 (after ``dramatiq-pg-outbox: error: interrupted`` on
        standard error) when the block is interrupted in the command.
      KeyboardInterrupt: When the block is interrupted in any other program.
    """
    try:
        yield
    except KeyboardInterrupt:
        if not launched_as_command():
            raise
        print(f"{PROG}: error: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
