"""What a :class:`~dramatiq_pg_outbox.PostgresBroker` runs in one process.

- ``process``: ``ProcessRuntime``, one per broker per process (a fork gets a fresh one):
  the connection pool, the consumers and the claims they hold.
- ``service``: :class:`~.service.Service`, the one shape of every background loop
  (start/stop, ``run_once`` returning counts, a ``ticked`` test signal, backoff).
- ``flusher``: buffers ack/nack/requeue decisions from worker threads and writes
  each kind with one set-based statement (River's batch completer is the model).
- ``maintenance``: heartbeat, release-stuck (rescue), orphans, history partitions.
- ``listener``: one LISTEN connection per process and database, fanned out to the
  consumers, the result waiters and the relay; a notification only wakes early.
- ``messages``: a message's stored form, the enqueue statement, notifications.
- ``host``: the protocols through which these parts see the broker and the runtime.
- ``watermark``: where a claim (a consumer's, the relay's) starts reading, so that a
  pinned MVCC horizon does not make every claim read every entry claimed since.

Connections per consuming process: ``pool_size`` (pool) + 1 (LISTEN, shared).
"""

from __future__ import annotations

from .host import Runtime, RuntimeHost, Wakeable
from .maintenance import Maintenance, RescueResult
from .messages import (
    SLOT_FREED,
    Conditional,
    EnqueueResult,
    Outcome,
    StoredMessage,
    enqueue_result,
    enqueue_statement,
    fence_params,
    format_error,
    idempotency_key,
    parse_notification,
)
from .process import ProcessRuntime
from .service import Every, Service

__all__ = [
    "SLOT_FREED",
    "Conditional",
    "EnqueueResult",
    "Every",
    "Maintenance",
    "Outcome",
    "ProcessRuntime",
    "RescueResult",
    "Runtime",
    "RuntimeHost",
    "Service",
    "StoredMessage",
    "Wakeable",
    "enqueue_result",
    "enqueue_statement",
    "fence_params",
    "format_error",
    "idempotency_key",
    "parse_notification",
]
