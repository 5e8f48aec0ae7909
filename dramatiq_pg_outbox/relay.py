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

import socket
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dramatiq import Broker, Message
from dramatiq.common import current_millis
from dramatiq.errors import DecodeError

from ._runtime import Service, _Maintenance, format_error, parse_notification
from ._runtime.listener import subscribe
from .broker import PostgresBroker
from .names import validate_queue_name

#: Messages per claim (default).
DEFAULT_BATCH_SIZE = 500
#: Back-off after a failure: first and largest wait, in seconds.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class TargetError(Exception):
    """Publishing to the target broker failed (the cause is chained).

    Attributes:
      confirmed(set[int]): Indexes, in the batch, of the messages the target confirmed before
        it failed (archived; the others are released).
    """

    def __init__(self, text: str, confirmed: set[int] | None = None) -> None:
        super().__init__(text)
        self.confirmed = confirmed or set()


class TargetUnusable(Exception):
    """The target broker cannot be used for a reason a retry cannot fix; the text is one line.

    Raised by :func:`check_target` (at start: wrong host, refused connection,
    refused credentials) and by :meth:`Relay.run` when the target refuses the
    credentials later (they were changed): retrying forever would only hide it.
    """


#: Exception class names of pika and redis-py that mean "credentials refused".
_AUTH_ERRORS = frozenset({
    "ProbableAuthenticationError", "AuthenticationError", "ProbableAccessDeniedError",
    "AuthenticationWrongNumberOfArgsError",
})  # fmt: skip


def _chain(error: BaseException | None, most: int = 5) -> list[BaseException]:
    """``error`` and the errors it wraps (``__cause__``, else ``__context__``), at most ``most``."""
    chain: list[BaseException] = []
    while error is not None and len(chain) < most:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def refused_credentials(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it wraps) says the target refused the relay's credentials."""
    return any(
        type(e).__name__ in _AUTH_ERRORS
        or any(word in str(e) for word in ("ACCESS_REFUSED", "WRONGPASS", "NOAUTH"))
        for e in _chain(error)
    )


def check_target(target: Broker, shown: str) -> None:
    """Connect and authenticate to a RabbitMQ or Redis target once (other brokers: nothing to do).

    Parameters:
      target(Broker): The target broker, from :func:`target_broker`.
      shown(str): Its URL with the password masked, for the message.

    Raises:
      TargetUnusable: One line: what failed and what to check in ``--to``.
    """
    kind = type(target).__name__
    try:
        if kind == "RabbitmqBroker":
            # Opens and authenticates this thread's connection (the relay publishes on it).
            _ = target.connection  # type: ignore[attr-defined]
        elif kind == "RedisBroker":
            target.client.ping()  # type: ignore[attr-defined]
    except Exception as e:
        chain = _chain(e)
        detail = " ".join(" ".join(f"{type(x).__name__}: {x}" for x in chain).split())[:300]
        if not any(str(x) for x in chain):
            # pika's AMQPConnectionError may carry nothing once its connection attempts ran out.
            raise TargetUnusable(
                f"cannot connect to {shown}: no connection ({type(e).__name__}). "
                "Check that the server runs and the host and port in --to"
            ) from None
        if refused_credentials(e):
            raise TargetUnusable(
                f"{shown} refused the relay's credentials ({detail}). "
                "Check the user name and password in --to"
            ) from None
        if isinstance(e, socket.gaierror) or "Name or service not known" in detail:
            raise TargetUnusable(f"cannot connect to {shown}: unknown host. Check the host in --to") from None
        if "refused" in detail.lower():
            raise TargetUnusable(
                f"cannot connect to {shown}: connection refused. "
                "Check that the server runs and the host and port in --to"
            ) from None
        raise TargetUnusable(f"cannot connect to {shown}: {detail}. Check --to") from None


class _Publisher:
    """Publish a batch of messages to a target broker; which of them it confirmed."""

    def __init__(self, target: Broker) -> None:
        self.target = target

    def publish(self, messages: list[Message[Any]]) -> set[int]:
        """Publish ``messages`` in order.  Returns the indexes the target confirmed.

        Raises:
          TargetError: With ``confirmed``, the indexes confirmed before the failure.
        """
        confirmed: set[int] = set()
        for i, message in enumerate(messages):
            try:
                self.target.enqueue(message)
            except Exception as e:
                raise TargetError(f"{type(e).__name__}: {e}", confirmed) from e
            confirmed.add(i)
        return confirmed


class _RabbitmqPublisher(_Publisher):
    """One AMQP transaction per batch on a channel of the target's connection (its thread's).

    The publishes are what ``RabbitmqBroker.enqueue`` sends (default exchange, routing key
    the queue, persistent, ``broker_priority``), after the same queue declarations, with the
    target's ``enqueue`` middleware hooks; only the confirmation differs.
    """

    def __init__(self, target: Broker) -> None:
        super().__init__(target)
        import pika

        self._pika = pika
        self._channel: Any = None
        self._returned: list[bytes] = []

    def _open(self) -> Any:
        if self._channel is None or not self._channel.is_open:
            channel = self.target.connection.channel()  # type: ignore[attr-defined]
            channel.tx_select()
            channel.add_on_return_callback(lambda _ch, _method, _props, body: self._returned.append(body))
            self._channel = channel
        return self._channel

    def publish(self, messages: list[Message[Any]]) -> set[int]:
        pika = self._pika
        target: Any = self.target
        bodies = [message.encode() for message in messages]
        self._returned = []
        try:
            for queue_name in dict.fromkeys(m.queue_name for m in messages):
                target.declare_queue(queue_name, ensure=True)
            channel = self._open()
            for message, body in zip(messages, bodies, strict=True):
                target.emit_before("enqueue", message, None)
                channel.basic_publish(
                    exchange="",
                    routing_key=message.queue_name,
                    body=body,
                    properties=pika.BasicProperties(
                        delivery_mode=2, priority=message.options.get("broker_priority")
                    ),
                    mandatory=True,
                )
            channel.tx_commit()
            target.connection.process_data_events(time_limit=0)  # runs the return callbacks
        except Exception as e:
            # The transaction did not commit (or its commit-ok was lost): nothing counts as
            # delivered.  A new connection and channel for the next batch.
            self._channel = None
            try:
                del target.connection
            except Exception:  # already gone
                pass
            raise TargetError(f"{type(e).__name__}: {e}") from e
        returned = set(self._returned)
        confirmed = {i for i, body in enumerate(bodies) if body not in returned}
        for i in confirmed:
            target.emit_after("enqueue", messages[i], None)
        if returned:
            # Unroutable: its queue was deleted since it was declared.  Declare it again next time.
            for i in set(range(len(messages))) - confirmed:
                target.queues_pending.add(messages[i].queue_name)
            raise TargetError(f"{len(returned)} message(s) returned as unroutable", confirmed)
        return confirmed


class _RedisPublisher(_Publisher):
    """Dramatiq's own enqueue script for each message of the batch, in one pipeline.

    The arguments are those ``RedisBroker.enqueue`` passes to it (Dramatiq 2.x's
    ``_dispatch``), maintenance excluded (the target's consumers do it).
    """

    def publish(self, messages: list[Message[Any]]) -> set[int]:
        target: Any = self.target
        try:
            dispatch = target.scripts["dispatch"]
            pipe = target.client.pipeline(transaction=False)
            stamped = []
            for message in messages:
                message = message.copy(options={"redis_message_id": str(uuid.uuid4())})
                target.emit_before("enqueue", message, None)
                # The arguments of Dramatiq's RedisBroker._dispatch("enqueue"), maintenance off.
                args = [
                    "enqueue", current_millis(), message.queue_name, target.broker_id,
                    target.heartbeat_timeout, target.dead_message_ttl, 0, target._max_unpack_size(),
                    message.options["redis_message_id"], message.encode(),
                ]  # fmt: skip
                dispatch(keys=[target.namespace], args=args, client=pipe)
                stamped.append(message)
            pipe.execute()
        except Exception as e:
            raise TargetError(f"{type(e).__name__}: {e}") from e
        for message in stamped:
            target.emit_after("enqueue", message, None)
        return set(range(len(messages)))


def _publisher_for(target: Broker) -> _Publisher:
    """The fastest publisher that knows ``target``'s class; ``enqueue()`` one by one otherwise."""
    kind = f"{type(target).__module__}.{type(target).__name__}"
    if kind == "dramatiq.brokers.rabbitmq.RabbitmqBroker":
        return _RabbitmqPublisher(target)
    if kind == "dramatiq.brokers.redis.RedisBroker":
        return _RedisPublisher(target)
    return _Publisher(target)


@dataclass
class RelayStats:
    """Counters of one :class:`Relay` since it started.

    Attributes:
      relayed(int): Messages published and archived.
      confirmed(Counter[str]): Messages the target confirmed, by queue name.
      archive_retries(int): Messages published whose archive failed at first (retried).
      released(int): Claimed messages handed back unpublished after a target failure.
      dead_lettered(int): Rows that could not be decoded (moved to history as failed).
      target_failures(int): Publish failures (each followed by a back-off).
      database_failures(int): PostgreSQL failures (each followed by a back-off).
      started(float): ``time.monotonic()`` at start.
    """

    relayed: int = 0
    confirmed: Counter[str] = field(default_factory=Counter)
    archive_retries: int = 0
    released: int = 0
    dead_lettered: int = 0
    target_failures: int = 0
    database_failures: int = 0
    started: float = field(default_factory=time.monotonic)

    def rate(self) -> float:
        """Messages relayed per second since the start."""
        return self.relayed / max(time.monotonic() - self.started, 1e-9)


class Relay(Service):
    """Move the committed, due messages of ``queues`` from a PostgresBroker to ``target``.

    Parameters:
      broker(PostgresBroker): Where the messages are written (its URL, schema, channel,
        ``heartbeat_*`` and ``max_fetch_interval`` settings are used).
      target(dramatiq.Broker): A ``RabbitmqBroker`` (each batch is one AMQP transaction)
        or a ``RedisBroker`` (each batch one pipeline); another broker's ``enqueue()`` is
        called message by message.
      queues(Sequence[str]): The queues to relay (validated; at least one).
      batch_size(int): Messages per claim (default 500).

    Raises:
      ValueError: If no queue is given, a queue name is invalid, or ``batch_size < 1``.

    :meth:`run` blocks until :meth:`stop`; :meth:`run_once` relays one batch.  The
    relay registers in the ``workers`` table and heartbeats like a worker process,
    so that its claims are rescued if it dies.  A :class:`~._runtime.Service`: after a
    failure it waits 0.5 s, doubling up to 30 s; a refused login to the target ends it
    (:class:`TargetUnusable`).
    """

    name = "relay"
    fatal = (TargetUnusable,)

    def __init__(
        self,
        broker: PostgresBroker,
        target: Broker,
        queues: Sequence[str],
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        if not queues:
            raise ValueError("a relay needs at least one queue")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size!r}")
        super().__init__(
            broker.options.max_fetch_interval / 1000, backoff_first=BACKOFF_FIRST_S, backoff_max=BACKOFF_MAX_S
        )
        self.broker = broker
        self.target = target
        self._publisher = _publisher_for(target)
        self.queues = sorted({validate_queue_name(q) for q in queues})
        self.batch_size = batch_size
        self.stats = RelayStats()
        self._unarchived: list[tuple[int, uuid.UUID]] = []
        self._maintenance: _Maintenance | None = None
        #: Messages relayed by the latest batch (a full batch: the next one starts at once).
        self._relayed = 0
        self._report_every = 0.0
        self._next_report = float("inf")

    # -- one batch ---------------------------------------------------------------------
    def run_once(self) -> int:
        """Relay one batch; the messages relayed (see :meth:`_batch`).

        Raises:
          TargetUnusable: The target refused the relay's credentials.
          TargetError: Publishing failed otherwise (the batch was released).
        """
        try:
            self._relayed = self._batch()
        except TargetError as e:
            if refused_credentials(e.__cause__):
                raise TargetUnusable(
                    f"the target refused the relay's credentials ({e}). Check the user name and "
                    "password in --to"
                ) from None
            raise
        return self._relayed

    def _batch(self) -> int:
        """Claim, publish and archive one batch.  Returns the messages relayed.

        Raises:
          psycopg.Error: PostgreSQL failed (claimed rows stay claimed; the rescuer or
            the next :meth:`run_once` handles them).
          Exception: Whatever the target raised, after the batch's published part was
            archived and the rest released.
        """
        runtime = self.broker.runtime
        if self._unarchived:
            self._archive(list(self._unarchived), retry=True)
        lease = uuid.uuid4()
        rows = runtime.execute(
            "relay_claim",
            {"queues": self.queues, "limit": self.batch_size, "lease": lease, "owner": runtime.worker_id},
        )
        if not rows:
            return 0
        rows.sort(key=lambda r: (r[2], r[0]))
        runtime.track(rows, lease)
        batch: list[tuple[int, Message[Any]]] = []
        dead: set[int] = set()
        confirmed: set[int] = set()
        try:
            for row_id, queue_name, _, payload in rows:
                try:
                    message = Message.decode(bytes(payload))
                except DecodeError as e:
                    self._dead_letter(row_id, lease, e)
                    dead.add(row_id)
                    continue
                if message.queue_name != queue_name:
                    message = message.copy(queue_name=queue_name)
                batch.append((row_id, message))
            confirmed = self._publisher.publish([message for _, message in batch])
        except BaseException as e:
            if isinstance(e, TargetError):
                self.stats.target_failures += 1
                confirmed = e.confirmed
            self.stats.confirmed.update(batch[i][1].queue_name for i in confirmed)
            published = [(row_id, lease) for i, (row_id, _) in enumerate(batch) if i in confirmed]
            done = {row_id for row_id, _ in published} | dead
            rest = [(r[0], lease) for r in rows if r[0] not in done]
            try:
                self._release(rest)
            finally:
                self._archive(published)
            raise
        self.stats.confirmed.update(message.queue_name for _, message in batch)
        published = [(row_id, lease) for row_id, _ in batch]
        self._archive(published)
        return len(published)

    def _archive(self, items: list[tuple[int, uuid.UUID]], *, retry: bool = False) -> None:
        """Move published rows to history; on failure keep them to retry before the next claim."""
        if not items:
            return
        try:
            # The consumers' own ack: fenced by lease, moved to history as completed.
            self.broker.runtime.execute(
                "ack", {"ids": [i for i, _ in items], "leases": [le for _, le in items]}
            )
        except BaseException:
            if not retry:
                self._unarchived.extend(items)
                self.stats.archive_retries += len(items)
            raise
        if retry:
            self._unarchived = []
        self.stats.relayed += len(items)
        self.broker.runtime.untrack(items)

    def _release(self, items: list[tuple[int, uuid.UUID]]) -> None:
        """Hand unpublished rows back; if that fails they become orphans, which the maintenance
        loop releases (``release_orphans``) once they are no longer tracked."""
        if not items:
            return
        try:
            self.broker.runtime.execute(
                "relay_release", {"ids": [i for i, _ in items], "leases": [le for _, le in items]}
            )
            self.stats.released += len(items)
        finally:
            self.broker.runtime.untrack(items)

    def _dead_letter(self, row_id: int, lease: uuid.UUID, error: DecodeError) -> None:
        self.logger.error("Dead-lettering undecodable message %d: %s", row_id, error)
        _, text = format_error(error.__cause__ or error)
        self.broker.runtime.execute(
            "archive",
            {
                "ids": [row_id],
                "leases": [lease],
                "state": "failed",
                "error_types": ["DecodeError"],
                "errors": [text],
            },
        )
        self.broker.runtime.untrack([(row_id, lease)])
        self.stats.dead_lettered += 1

    # -- observing ---------------------------------------------------------------------
    def lag(self) -> dict[str, tuple[float, int]]:
        """Per queue: (seconds the oldest due unrelayed message has waited, due messages waiting)."""
        rows = self.broker.runtime.execute("relay_lag", {"queues": self.queues})
        return {str(q): (float(age), int(n)) for q, age, n in rows}

    def _next_due_s(self) -> float | None:
        rows = self.broker.runtime.execute("relay_next_due", {"queues": self.queues})
        return None if not rows or rows[0][0] is None else max(0.0, float(rows[0][0]) / 1000)

    # -- the loop ----------------------------------------------------------------------
    def run(self, *, report_every: float = 0) -> None:
        """Relay until :meth:`stop`.  Failures are logged and retried with a back-off.

        Parameters:
          report_every(float): Log a line with the counters and the lag every this many
            seconds (0: never).

        Raises:
          TargetUnusable: The target refused the relay's credentials.
        """
        runtime = self.broker.runtime
        self._maintenance = _Maintenance(runtime)
        self._maintenance.heartbeat()
        self._maintenance.start()
        self._report_every = report_every
        self._next_report = time.monotonic() + report_every if report_every else float("inf")
        subscription = None
        if self.broker.options.listen:
            subscription = subscribe(self.broker.conninfo, self.broker.channel, self._notified, self.wake)
        try:
            self.run_forever()
        finally:
            if subscription is not None:
                subscription.close()
            self._maintenance.stop()

    def _notified(self, payload: str) -> None:
        queue_name, _ = parse_notification(payload)
        if queue_name is None or queue_name in self.queues:
            self.wake()

    def next_delay(self) -> float:
        """At once after a full batch; else until the next delayed message, at most ``max_fetch_interval``."""
        if time.monotonic() >= self._next_report:
            self._next_report = time.monotonic() + self._report_every
            self._report()
        if self._relayed >= self.batch_size:
            return 0.0
        try:
            due = self._next_due_s()
        except Exception:
            due = None
        return self.interval if due is None else min(self.interval, due + 0.001)

    def log_failure(self, error: Exception, delay: float) -> None:
        if isinstance(error, TargetError):
            self.logger.warning("Publishing to the target failed (%s); retrying in %.1f s", error, delay)
        else:
            self.stats.database_failures += 1
            self.logger.warning("PostgreSQL failed (%s); retrying in %.1f s", error, delay)

    def _report(self) -> None:
        try:
            lag = self.lag()
        except Exception:
            lag = {}
        shown = ", ".join(f"{q}: {age:.1f} s ({n} due)" for q, (age, n) in lag.items())
        self.logger.info(
            "relayed %d (%.0f/s since start), released %d, target failures %d; lag %s",
            self.stats.relayed,
            self.stats.rate(),
            self.stats.released,
            self.stats.target_failures,
            shown or "unknown",
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Make :meth:`run` return after the batch in progress (thread-safe)."""
        super().stop(timeout)


class RelayCollector:
    """A ``prometheus_client`` collector of one relay (``dramatiq-pg-outbox relay --metrics-port``).

    Metrics (prefix ``dramatiq_pg_outbox_``, label ``queue_name``):
    ``relay_confirmed_total`` (messages the target confirmed, a counter),
    ``relay_lag_seconds`` (how long the oldest due unrelayed message has waited; one
    statement per scrape, :meth:`Relay.lag`), ``relay_due_messages`` (due messages
    waiting), and without a label ``relay_target_failures_total`` and
    ``relay_released_total``.  ``rate(dramatiq_pg_outbox_relay_confirmed_total[1m])`` is the
    relayed rate.  A scrape whose lag query fails omits the two lag gauges.

    Raises:
      ImportError: If ``prometheus_client`` is not installed (extra ``metrics``).
    """

    def __init__(self, relay: Relay) -> None:
        import prometheus_client  # noqa: F401 - fail early if missing

        self.relay = relay

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        prefix = "dramatiq_pg_outbox_relay"
        stats = self.relay.stats
        confirmed = CounterMetricFamily(
            f"{prefix}_confirmed", "Messages the target confirmed", labels=["queue_name"]
        )
        for queue_name in self.relay.queues:
            confirmed.add_metric([queue_name], stats.confirmed.get(queue_name, 0))
        yield confirmed
        yield CounterMetricFamily(
            f"{prefix}_target_failures",
            "Publish failures (each followed by a back-off)",
            stats.target_failures,
        )
        yield CounterMetricFamily(
            f"{prefix}_released", "Claimed messages handed back unpublished after a failure", stats.released
        )
        try:
            lag = self.relay.lag()
        except Exception:
            return
        seconds = GaugeMetricFamily(
            f"{prefix}_lag_seconds",
            "Seconds the oldest due unrelayed message has waited",
            labels=["queue_name"],
        )
        due = GaugeMetricFamily(f"{prefix}_due_messages", "Due messages waiting", labels=["queue_name"])
        for queue_name, (age, waiting) in sorted(lag.items()):
            seconds.add_metric([queue_name], age)
            due.add_metric([queue_name], waiting)
        yield seconds
        yield due


def target_broker(url: str) -> Broker:
    """Dramatiq's RabbitmqBroker (``amqp://``, ``amqps://``; with publisher confirms) or RedisBroker
    (``redis://``, ``rediss://``, ``unix://``) for a URL.

    Raises:
      ValueError: For another scheme.
      ImportError: If pika (RabbitMQ) or redis is not installed (``pip install 'dramatiq[rabbitmq]'``
        or ``'dramatiq[redis]'``).
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("amqp", "amqps"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url, confirm_delivery=True)
    if scheme in ("redis", "rediss", "unix"):
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=url)
    raise ValueError(f"--to must be an amqp://, amqps://, redis:// or rediss:// URL, not {scheme or url!r}")


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "Relay",
    "RelayCollector",
    "RelayStats",
    "TargetError",
    "TargetUnusable",
    "check_target",
    "target_broker",
]
