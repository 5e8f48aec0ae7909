"""What the runtime's parts see of each other: protocols, so that no part imports the broker."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import psycopg

from ..options import BrokerOptions
from ..store.messages import MessageStore


class RuntimeHost(Protocol):
    """What a runtime reads of its broker (:class:`~dramatiq_pg_outbox.PostgresBroker`).

    Times are in milliseconds, as the broker's options.  A protocol, so that
    this module never imports the broker's.
    """

    @property
    def conninfo(self) -> str: ...
    @property
    def safe_url(self) -> str: ...
    @property
    def schema(self) -> str: ...
    @property
    def channel(self) -> str: ...
    @property
    def options(self) -> BrokerOptions: ...
    @property
    def _metrics(self) -> Any: ...

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None: ...

    def get_declared_actors(self) -> set[str]: ...


class Wakeable(Protocol):
    """A consumer as the runtime sees it: woken by notifications (``_PostgresConsumer``)."""

    @property
    def queue_name(self) -> str: ...

    def notify(self) -> None: ...

    def notify_due(self, due_ms: int, at: float) -> None: ...

    def prioritize(self) -> None: ...

    def slot_freed(self) -> None: ...

    def close(self) -> None: ...


class Runtime(Protocol):
    """What the flusher and the maintenance loop use of their process's runtime (``process._Runtime``)."""

    broker: RuntimeHost
    store: MessageStore
    channel: str
    worker_id: uuid.UUID
    #: ``psycopg.Connection.connect`` keyword arguments of the process's connections.
    connect_kwargs: dict[str, Any]

    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...

    def wake(self, queue_name: str | None, due_ms: int | None = None) -> None: ...

    def untrack(self, items: Sequence[tuple[Any, ...]]) -> None: ...

    def known_claims(self) -> list[int]: ...

    def queue_names(self) -> list[str]: ...

    def running_ids(self) -> list[int]: ...

    def request_cancel(self, row_ids: Sequence[int]) -> int: ...
