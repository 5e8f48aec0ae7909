"""The relay loop: claim committed, due messages, publish them to the target, archive them."""

from __future__ import annotations

import datetime
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from dramatiq import Broker, Message
from dramatiq.errors import DecodeError

from .._runtime import Maintenance, Service, fence_params, format_error, parse_notification
from .._runtime.listener import subscribe
from .._runtime.watermark import Watermark
from ..broker import PostgresBroker
from ..names import validate_queue_name
from ..store.relay import RelayStore
from .targets import TargetError, TargetUnusable, publisher_for, refused_credentials

#: Messages per claim (default).
DEFAULT_BATCH_SIZE = 500
#: Back-off after a failure: first and largest wait, in seconds.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


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
        self._publisher = publisher_for(target)
        self.queues = sorted({validate_queue_name(q) for q in queues})
        self.batch_size = batch_size
        self.stats = RelayStats()
        self._store = RelayStore(broker.schema)
        self._unarchived: list[tuple[int, uuid.UUID]] = []
        self._maintenance: Maintenance | None = None
        #: Messages relayed by the latest batch (a full batch: the next one starts at once).
        self._relayed = 0
        #: Where its claims start reading (see _runtime/watermark.py).
        self.watermark = Watermark()
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
        sent = time.monotonic()
        sweep, bound = self.watermark.start(sent)
        with runtime.connection() as conn:
            rows = self._store.claim(
                conn,
                queues=self.queues,
                limit=self.batch_size,
                lease=lease,
                owner=runtime.worker_id,
                # The watermark's key (see _runtime/watermark.py), both None for a sweep.
                from_at=cast("datetime.datetime | None", bound["from_at"]),
                from_id=cast("int | None", bound["from_id"]),
            )
        rows.sort(key=lambda r: (r.next_attempt_at, r.id))
        self.watermark.claimed(
            [(r.next_attempt_at, int(r.id)) for r in rows],
            full=len(rows) >= self.batch_size,
            sweep=sweep,
            sent=sent,
        )
        if not rows:
            return 0
        runtime.track([r.id for r in rows], lease)
        batch: list[tuple[int, Message[Any]]] = []
        dead: set[int] = set()
        confirmed: set[int] = set()
        try:
            for row in rows:
                try:
                    message = Message.decode(bytes(row.payload))
                except DecodeError as e:
                    self._dead_letter(row.id, lease, e)
                    dead.add(row.id)
                    continue
                if message.queue_name != row.queue_name:
                    message = message.copy(queue_name=row.queue_name)
                batch.append((row.id, message))
            confirmed = self._publisher.publish([message for _, message in batch])
        except BaseException as e:
            if isinstance(e, TargetError):
                self.stats.target_failures += 1
                confirmed = e.confirmed
            self.stats.confirmed.update(batch[i][1].queue_name for i in confirmed)
            published = [(row_id, lease) for i, (row_id, _) in enumerate(batch) if i in confirmed]
            done = {row_id for row_id, _ in published} | dead
            rest = [(r.id, lease) for r in rows if r.id not in done]
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
            runtime = self.broker.runtime
            with runtime.connection() as conn:
                runtime.store.ack(conn, **fence_params(items))
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
            with self.broker.runtime.connection() as conn:
                self._store.release(conn, **fence_params(items))
            self.stats.released += len(items)
        finally:
            self.broker.runtime.untrack(items)

    def _dead_letter(self, row_id: int, lease: uuid.UUID, error: DecodeError) -> None:
        self.logger.error("Dead-lettering undecodable message %d: %s", row_id, error)
        _, text = format_error(error.__cause__ or error)
        runtime = self.broker.runtime
        with runtime.connection() as conn:
            runtime.store.archive(
                conn,
                **fence_params([(row_id, lease)]),
                state="failed",
                error_types=["DecodeError"],
                errors=[text],
            )
        self.broker.runtime.untrack([(row_id, lease)])
        self.stats.dead_lettered += 1

    # -- observing ---------------------------------------------------------------------
    def lag(self) -> dict[str, tuple[float, int]]:
        """Per queue: (seconds the oldest due unrelayed message has waited, due messages waiting)."""
        with self.broker.runtime.connection() as conn:
            rows = self._store.lag(conn, queues=self.queues)
        return {str(r.queue_name): (float(r.age_s), int(r.due)) for r in rows}

    def _next_due_s(self) -> float | None:
        with self.broker.runtime.connection() as conn:
            due_ms = self._store.next_due_ms(conn, queues=self.queues)
        return None if due_ms is None else max(0.0, due_ms / 1000)

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
        self._maintenance = Maintenance(runtime)
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
            # What was stored or released may lie behind the watermark: sweep soon.
            self.watermark.owe_sweep()
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
        delay = self.interval if due is None else min(self.interval, due + 0.001)
        return min(delay, max(0.0, self.watermark.wake_at() - time.monotonic()))

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
