"""dramatiq-pg-outbox: a PostgreSQL broker for Dramatiq with transactional enqueue."""

from __future__ import annotations

from ._launch import interruptible_imports

# A Ctrl-C while these import (the command's first moments) is one line in the command.
with interruptible_imports():
    from .broker import PostgresBroker
    from .broker.consumer import is_canceled
    from .errors import Canceled, MessageTooLarge, OutboxError, SchemaNotReady
    from .migrations import downgrade, upgrade, versions_path
    from .outbox import Outbox, outbox, outside_outbox
    from .results import PostgresBackend

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
