"""dramatiq-pg-outbox: a PostgreSQL broker for Dramatiq with transactional enqueue.

The names below are imported on first use (PEP 562): a process that needs one module of
the package imports that module only.  A Spark task's Python worker unpickles the
``format("dramatiq")`` writer (``dramatiq_pg_outbox.spark.source``) and runs
``dramatiq_pg_outbox.spark.write``: it does not import the broker, SQLAlchemy or the
outbox (about 0.3 s of each new Python process of a Spark write; benchmarks/README.md
section 21).
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._launch import interruptible_imports

if TYPE_CHECKING:
    from .broker import PostgresBroker
    from .broker.consumer import is_canceled
    from .errors import Canceled, MessageTooLarge, OutboxError, SchemaNotReady
    from .migrations import downgrade, upgrade, versions_path
    from .outbox import Outbox, outbox, outside_outbox
    from .results import PostgresBackend

#: Each exported name and the module that defines it.
_EXPORTS = {
    "Canceled": ".errors",
    "MessageTooLarge": ".errors",
    "Outbox": ".outbox",
    "OutboxError": ".errors",
    "PostgresBackend": ".results",
    "PostgresBroker": ".broker",
    "SchemaNotReady": ".errors",
    "downgrade": ".migrations",
    "is_canceled": ".broker.consumer",
    "outbox": ".outbox",
    "outside_outbox": ".outbox",
    "upgrade": ".migrations",
    "versions_path": ".migrations",
}

__all__ = [
    "Canceled",
    "MessageTooLarge",
    "Outbox",
    "OutboxError",
    "PostgresBackend",
    "PostgresBroker",
    "SchemaNotReady",
    "downgrade",
    "is_canceled",
    "outbox",
    "outside_outbox",
    "upgrade",
    "versions_path",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """An exported name, imported from its module on first use (then a plain attribute)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # A Ctrl-C while these import (the command's first moments) is one line in the command.
    with interruptible_imports():
        value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """This package's module: its ``outbox`` is the function, not the subpackage of that name.

    Importing a submodule binds it on its package once it has run; for
    ``dramatiq_pg_outbox.outbox`` (imported by ``dramatiq_pg_outbox.django``, or as
    ``from dramatiq_pg_outbox.outbox import ...``) that would hide the ``outbox()`` function
    that ``from dramatiq_pg_outbox import outbox`` gives, as the eager import it replaces did.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "outbox" and isinstance(value, types.ModuleType):
            value = value.outbox
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
