"""The outbox relay: committed messages of chosen queues, moved from PostgreSQL to another broker.

The application keeps writing messages through :func:`~dramatiq_pg_outbox.outbox`
(or ``send()``) into the ``messages`` table, so a message exists exactly when its
transaction commits; a :class:`Relay` (or ``dramatiq-pg-outbox relay``) claims the
due messages of its queues and publishes them to Dramatiq's ``RabbitmqBroker`` or
``RedisBroker``, whose ordinary workers consume them.  This is the
"transactional outbox + message relay" pattern (Chris Richardson,
microservices.io, "Pattern: Transactional outbox"; Debezium's outbox event
router does the same from the WAL).  Queues not given to a relay stay consumed
locally by ``PostgresBroker`` workers; a queue must not have both (the two would
compete for its rows).

Delivery is at least once, nothing lost:

1. a batch of due rows (``next_attempt_at <= now()``, oldest first) is claimed with
   ``FOR UPDATE SKIP LOCKED`` under a new lease, like a consumer's claim but
   without counting a delivery (a relay that dies does not push a message
   towards ``max_deliveries``); several relays may run side by side;
2. the batch is published in order (per queue, the order of due time then id)
   and confirmed by the target as a whole, one round trip per batch:
   RabbitMQ: an AMQP transaction (``tx.select``, the publishes, ``tx.commit``:
   ``commit-ok`` means the broker has taken every message of the batch, as a
   publisher confirm does for one; messages published in a transaction that
   never commits are discarded by RabbitMQ), with ``mandatory`` publishes, so a
   message returned as unroutable is not counted as delivered; Redis: Dramatiq's
   own enqueue script for every message, sent in one pipeline; another broker:
   its ``enqueue()``, message by message;
3. only then are the published rows moved to ``history`` (state ``completed``),
   fenced by their lease; if that fails (PostgreSQL lost) it is retried before
   anything else is claimed, never re-published by this relay.

If the target fails, whatever it did not confirm is released at once (it keeps
its place): for RabbitMQ and Redis the whole batch, for other brokers the
messages after the last confirmed one.  The relay backs off (doubling from
0.5 s to 30 s) and retries; it reconnects by itself.  A relay killed between a
publish and its archive (or whose ``commit-ok`` was lost) leaves its claim to
the rescuer (this relay's own maintenance loop, or any worker's, after
``heartbeat_timeout``), and the messages are published again: the duplicate
window is that one batch.  Dramatiq message ids are kept, so a consumer that
must not run twice can drop an id it has seen (docs/guarantees.md).

Wake-ups: the broker's channel on the process's one LISTEN connection
(``_runtime.listener``; the notification of a commit or of a
due delayed message), and polling every ``max_fetch_interval`` as fallback; a
delayed message is claimed when due (the relay sleeps until the earliest due
time of its queues), so the target never holds our delayed messages.
"""

from __future__ import annotations

from .relay import BACKOFF_FIRST_S, BACKOFF_MAX_S, DEFAULT_BATCH_SIZE, Relay, RelayCollector, RelayStats
from .targets import TargetError, TargetUnusable, check_target, refused_credentials, target_broker

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "DEFAULT_BATCH_SIZE",
    "Relay",
    "RelayCollector",
    "RelayStats",
    "TargetError",
    "TargetUnusable",
    "check_target",
    "refused_credentials",
    "target_broker",
]
