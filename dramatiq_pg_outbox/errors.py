"""Errors raised by dramatiq-pg-outbox, rooted in Dramatiq's error tree."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import psycopg_pool
from dramatiq.errors import BrokerError, ConnectionClosed, ConnectionFailed


class SchemaNotReady(BrokerError):
    """The broker's tables are missing or older than this version of the package needs.

    The message names the command that fixes it (``dramatiq-pg-outbox migrate``).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)  # type: ignore[no-untyped-call]


class OutboxError(BrokerError):
    """A transactional enqueue was used wrongly (for example, an ``AsyncSession`` in a sync ``with``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)  # type: ignore[no-untyped-call]


@contextmanager
def translate_errors() -> Iterator[None]:
    """Turn psycopg connection errors into Dramatiq's ``ConnectionClosed``/``ConnectionFailed``.

    Dramatiq's Worker restarts consumers, and retries acks, only for those
    errors (subclasses of ``BrokerConnectionError``).  Other database errors
    propagate unchanged.
    """
    try:
        yield
    except psycopg_pool.PoolTimeout as e:
        raise ConnectionFailed(f"could not get a PostgreSQL connection from the pool: {e}") from e
    except (psycopg.OperationalError, psycopg.InterfaceError) as e:
        raise ConnectionClosed(f"lost the PostgreSQL connection: {e}") from e
