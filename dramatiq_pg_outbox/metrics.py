"""Prometheus metrics: database gauges for a cluster, counters from worker processes.

Two sources, both with the ``prometheus_client`` library (extra ``metrics``:
``pip install 'dramatiq-pg-outbox[metrics]'``):

* :class:`DatabaseCollector` reads the state of a whole cluster from its tables
  with one statement per scrape, cached for ``cache_seconds`` (default 5) so
  that many scrapers (or an HA pair of Prometheus servers) cost one statement.
  ``dramatiq-pg-outbox metrics --port 9192`` serves it over HTTP.
* :class:`WorkerMetrics`, a Dramatiq middleware, counts what each worker
  process's consumers do (claims, acks, nacks, requeues, stale decisions,
  rescues) and times claims and flushes.  Under the ``dramatiq`` CLI's several
  processes it uses ``prometheus_client``'s multiprocess mode in the directory
  of Dramatiq's own ``Prometheus`` middleware, so Dramatiq's exposition server
  (port ``$dramatiq_prom_port``, default 9191) serves its metrics and ours
  together.  Without that middleware, set ``PROMETHEUS_MULTIPROC_DIR`` yourself
  before the workers start, or serve :attr:`WorkerMetrics.registry` in a
  single process.

Names follow Prometheus' conventions (``_total`` counters, ``_seconds`` units,
a ``queue_name`` label like Dramatiq's) under the prefix ``dramatiq_pg_outbox_``,
which no Dramatiq metric uses (Dramatiq's are ``dramatiq_*``).

Database gauges (label ``queue_name`` unless said otherwise):

==========================================================  ==========================================
``dramatiq_pg_outbox_messages{queue_name, state}``           messages by state: ``due`` (pending, due
                                                             now), ``delayed`` (pending, due later),
                                                             ``processing``
``dramatiq_pg_outbox_oldest_due_message_age_seconds``        seconds since the longest-waiting due
                                                             message became due (0 when none is due)
``dramatiq_pg_outbox_dead_letters_last_hour``                messages dead-lettered in the last hour
``dramatiq_pg_outbox_dead_lettered_total`` (a counter)       messages dead-lettered so far (a nack
                                                             after the last retry, a quarantine, an
                                                             undecodable payload; not an operator's
                                                             cancel): ``rate()`` works, ``prune``
                                                             does not lower it (migration 0012)
``dramatiq_pg_outbox_live_workers`` (no label)               worker processes whose last heartbeat is
                                                             younger than ``heartbeat_timeout``
``dramatiq_pg_outbox_queue_paused``                          1 while the queue is paused
                                                             (``dramatiq-pg-outbox pause``), else 0
``dramatiq_pg_outbox_database_up`` (no label)                1 if the last statement succeeded, else 0
``dramatiq_pg_outbox_oldest_running_message_age_seconds``    seconds since the oldest claim of a
                                                             message still processing (0 when none)
``dramatiq_pg_outbox_queue_live_workers``                    live worker processes consuming the queue
``dramatiq_pg_outbox_schedule_lateness_seconds``             seconds an enabled schedule's next tick
(labels ``schedule``, ``queue_name``)                        is overdue (0 when not): no scheduler runs
``dramatiq_pg_outbox_messages_finished_total`` (a counter;   messages moved to history so far, by
labels ``queue_name``, ``actor_name``, ``state``)            outcome: ``completed``, ``retried`` (the
                                                             actor raised, its retry was enqueued),
                                                             ``failed`` (dead-lettered, as counted by
                                                             ``dead_lettered_total``), ``canceled``
                                                             (an operator's cancel, migration 0022:
                                                             not a dead letter); counted by the
                                                             statements that archive them, one upsert
                                                             per (queue, actor) of a batch (migration
                                                             0018); ``prune`` does not lower it
==========================================================  ==========================================

With a ``read_url`` (a hot standby), the gauges are read there, and two more say how far
behind the primary they are (no label; see :class:`~dramatiq_pg_outbox.store.admin.ReadLag`):

==========================================================  ==========================================
``dramatiq_pg_outbox_read_lag_seconds``                      seconds the standby's data is behind: 0
                                                             when it has replayed all the primary's
                                                             WAL (caught up, even if idle), else the
                                                             age of its last replayed commit; absent
                                                             while unknown (no commit replayed yet)
``dramatiq_pg_outbox_read_lag_bytes``                        bytes of WAL written on the primary and
                                                             not replayed yet; absent while the
                                                             primary is not reached
==========================================================  ==========================================

A queue the collector has seen keeps its series when it empties: they read 0, not absent.
Delay queues (``X.DQ``) are folded into their queue ``X``, as on the dashboard.

Worker counters and histograms: ``dramatiq_pg_outbox_claimed_total``,
``_acked_total``, ``_nacked_total``, ``_requeued_total`` (label ``queue_name``;
counted when the consumer decides, before the batched write),
``_stale_decisions_total`` (acks, nacks or requeues the flush found fenced out
by a newer lease), ``_rescued_total`` and ``_quarantined_total`` (messages of
dead workers released or dead-lettered by this process's rescuer),
``_claim_duration_seconds`` (label ``queue_name``) and
``_flush_duration_seconds`` (label ``statement``: ack, ack_with_error, nack,
requeue).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.common import q_name
from dramatiq.middleware import Middleware

from ._isolation import connect
from .options import HEARTBEAT_TIMEOUT_MS
from .store.admin import AdminStore, ReadLag, read_lag
from .urls import libpq_url

if TYPE_CHECKING:
    from dramatiq import Broker
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

PREFIX = "dramatiq_pg_outbox"
#: The states of the ``messages`` gauge.
STATES = ("due", "delayed", "processing")
#: Default seconds a scrape's result is reused.
DEFAULT_CACHE_SECONDS = 5.0
INSTALL_HINT = "pip install 'dramatiq-pg-outbox[metrics]'"


@dataclass(frozen=True)
class Snapshot:
    """One reading of the gauges.

    Attributes:
      messages(dict[tuple[str, str], float]): ``(queue_name, state) -> count``.
      oldest_due_age(dict[str, float]): ``queue_name -> seconds``.
      dead_letters_last_hour(dict[str, float]): ``queue_name -> count``.
      live_workers(float): Worker processes with a fresh heartbeat.
      up(bool): Whether the statement succeeded (all else is empty when not).
      taken_at(float): ``time.monotonic()`` when it was read.
      paused(set[str]): The paused queues (``dramatiq-pg-outbox pause``).
      dead_lettered(dict[str, float]): ``queue_name -> dead letters so far`` (a counter).
      oldest_running_age(dict[str, float]): ``queue_name -> seconds`` since the oldest claim
        of a message still processing.
      queue_workers(dict[str, float]): ``queue_name -> live worker processes consuming it``.
      schedule_lateness(dict[tuple[str, str], float]): ``(schedule, queue_name) -> seconds``
        its next tick is overdue (0 when not), enabled schedules only.
      finished(dict[tuple[str, str, str], float]): ``(queue_name, actor_name, state) ->
        messages finished so far`` (a counter; state completed, retried or failed).
      read_lag(ReadLag|None): How far the ``read_url``'s server is behind the primary, read
        after the gauges; None without a ``read_url``.

    Delay queues (``X.DQ``, a name Dramatiq gives them) are folded into their queue, as
    on the dashboard: counts add up, ages take the larger.
    """

    messages: dict[tuple[str, str], float]
    oldest_due_age: dict[str, float]
    dead_letters_last_hour: dict[str, float]
    live_workers: float
    up: bool
    taken_at: float
    paused: set[str] = field(default_factory=set)
    dead_lettered: dict[str, float] = field(default_factory=dict)
    oldest_running_age: dict[str, float] = field(default_factory=dict)
    queue_workers: dict[str, float] = field(default_factory=dict)
    schedule_lateness: dict[tuple[str, str], float] = field(default_factory=dict)
    finished: dict[tuple[str, str, str], float] = field(default_factory=dict)
    read_lag: ReadLag | None = None


#: The outcomes of ``messages_finished_total`` (``finished_counts.state``, migration 0018).
FINISHED_STATES = ("completed", "retried", "failed", "canceled")


class DatabaseCollector:
    """A ``prometheus_client`` collector of the gauges of one schema (see the module docstring).

    Parameters:
      url(str): PostgreSQL URL (``postgresql://`` or SQLAlchemy's ``postgresql+psycopg://``),
        or a libpq conninfo string (``host=... dbname=...``).
      schema(str): Schema of the tables (default ``"dramatiq"``).
      cache_seconds(float): Seconds a reading is reused (default 5; 0 reads at every scrape).
      heartbeat_timeout(int): Milliseconds after which a silent worker is not counted live: pass
        the workers' ``heartbeat_timeout`` (default
        :data:`~dramatiq_pg_outbox.options.HEARTBEAT_TIMEOUT_MS`, the broker's default, 20,000).
      read_url(str|None): URL (or conninfo) of a hot standby of ``url``'s server: the gauge
        statement runs there, and ``url`` is asked only how far the standby is behind
        (``read_lag_seconds``, ``read_lag_bytes``).  ``database_up`` is then the standby's: a
        primary that does not answer leaves the gauges served, the lag measured without it.
        Default None: everything on ``url``.

    A failing statement is logged by the caller of :meth:`read` and reported as
    ``dramatiq_pg_outbox_database_up 0``; the connection is opened again at the next read.
    Concurrent scrapes share one statement (a lock around the read).
    """

    def __init__(
        self,
        url: str,
        schema: str = "dramatiq",
        *,
        cache_seconds: float = DEFAULT_CACHE_SECONDS,
        heartbeat_timeout: int = HEARTBEAT_TIMEOUT_MS,
        read_url: str | None = None,
    ) -> None:
        if cache_seconds < 0:
            raise ValueError(f"cache_seconds must be >= 0, not {cache_seconds!r}")
        self.url = libpq_url(url) if "://" in url else url
        self.read_url = None if read_url is None else libpq_url(read_url) if "://" in read_url else read_url
        self.schema = schema
        self.cache_seconds = cache_seconds
        self.heartbeat_timeout = heartbeat_timeout
        #: Statements run so far (each scrape that was not served from the cache).
        self.statements = 0
        #: The last error text, if the last statement failed.
        self.last_error: str | None = None
        self._store = AdminStore(schema)
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        #: The read server's connection (``read_url``); None without one, or until opened.
        self._read_conn: psycopg.Connection[Any] | None = None
        self._snapshot: Snapshot | None = None
        #: Every queue seen by this collector: a queue that empties reads 0 instead of vanishing.
        self._seen: set[str] = set()
        #: Every (queue, actor) finished_total has served: each gets all three outcomes.
        self._seen_actors: set[tuple[str, str]] = set()

    def read(self) -> Snapshot:
        """The cached reading, or a new one if it is older than ``cache_seconds``."""
        with self._lock:
            snap = self._snapshot
            if snap is not None and time.monotonic() - snap.taken_at < self.cache_seconds:
                return snap
            self._snapshot = snap = self._query()
            return snap

    def _primary(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.url, autocommit=True, connect_timeout=10)
        return self._conn

    def _reads(self) -> psycopg.Connection[Any]:
        if self.read_url is None:
            return self._primary()
        if self._read_conn is None or self._read_conn.closed:
            self._read_conn = connect(self.read_url, autocommit=True, connect_timeout=10)
        return self._read_conn

    def _lag(self, reads: psycopg.Connection[Any]) -> ReadLag:
        """The read server's lag; a primary that fails is closed (opened again next time)."""
        try:
            primary: psycopg.Connection[Any] | None = self._primary()
            error = ""
        except psycopg.Error as e:
            primary, error = None, " ".join(str(e).split()) or type(e).__name__
        lag = read_lag(reads, primary, error)
        if lag.primary_error is not None and self._conn is not None:
            self._conn.close()
            self._conn = None
        return lag

    def _query(self) -> Snapshot:
        self.statements += 1
        lag = None
        try:
            reads = self._reads()
            gauges = self._store.metrics_gauges(reads, heartbeat_timeout_ms=self.heartbeat_timeout)
            if self.read_url is not None:
                lag = self._lag(reads)
        except psycopg.Error as e:
            self.last_error = " ".join(str(e).split())
            for conn in (self._conn, self._read_conn):
                if conn is not None:
                    conn.close()
            self._conn = self._read_conn = None
            return Snapshot({}, {}, {}, 0.0, False, time.monotonic())
        self.last_error = None
        messages: dict[tuple[str, str], float] = {}
        oldest: dict[str, float] = {}
        running: dict[str, float] = {}
        dead: dict[str, float] = {}
        workers = 0.0
        queue_workers: dict[str, float] = {}
        paused: set[str] = set()
        dead_total: dict[str, float] = {}
        late: dict[tuple[str, str], float] = {}
        finished: dict[tuple[str, str, str], float] = {}

        def add(into: dict[Any, float], key: Any, value: float) -> None:
            into[key] = into.get(key, 0.0) + value

        def most(into: dict[Any, float], key: Any, value: float) -> None:
            into[key] = max(into.get(key, value), value)

        for gauge in gauges:
            kind, value = gauge.kind, gauge.value
            # A delay queue's rows count for its queue (the dashboard folds them the same way).
            queue_name = q_name(str(gauge.queue_name))
            if kind == "messages":
                add(messages, (queue_name, str(gauge.state)), value)
            elif kind == "oldest":
                most(oldest, queue_name, value)
            elif kind == "running":
                most(running, queue_name, value)
            elif kind == "dead":
                add(dead, queue_name, value)
            elif kind == "queue_workers":
                # A worker that consumes X and X.DQ is one worker of X.
                most(queue_workers, queue_name, value)
            elif kind == "paused":
                paused.add(queue_name)
            elif kind == "dead_total":
                add(dead_total, queue_name, value)
            elif kind == "schedule_late":
                late[(str(gauge.state), queue_name)] = value
            elif kind == "finished":
                add(finished, (queue_name, str(gauge.actor_name), str(gauge.state)), value)
            else:
                workers = value
        return Snapshot(
            messages,
            oldest,
            dead,
            workers,
            True,
            time.monotonic(),
            paused,
            dead_total,
            running,
            queue_workers,
            late,
            finished,
            lag,
        )

    def collect(self) -> Iterator[Metric]:
        """Yield the gauges (``prometheus_client``'s collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.read()
        up = GaugeMetricFamily(f"{PREFIX}_database_up", "1 if the last gauge statement succeeded, else 0")
        up.add_metric([], 1.0 if snap.up else 0.0)
        yield up
        if not snap.up:
            return
        messages = GaugeMetricFamily(
            f"{PREFIX}_messages",
            "Messages by queue and state (due, delayed, processing)",
            labels=["queue_name", "state"],
        )
        with self._lock:
            self._seen |= {q for q, _ in snap.messages} | snap.paused | set(snap.dead_letters_last_hour)
            self._seen |= set(snap.dead_lettered) | set(snap.queue_workers)
            self._seen |= {q for q, _, _ in snap.finished}
            queues = sorted(self._seen)
            self._seen_actors |= {(q, a) for q, a, _ in snap.finished}
            actors = sorted(self._seen_actors)
        for queue_name in queues:
            for state in STATES:
                messages.add_metric([queue_name, state], snap.messages.get((queue_name, state), 0.0))
        yield messages

        def per_queue(family: Any, values: Callable[[str], float]) -> Any:
            # Every queue seen gets a sample (0 rather than absent once it empties).
            for queue_name in queues:
                family.add_metric([queue_name], values(queue_name))
            return family

        def gauge(name: str, text: str) -> Any:
            return GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=["queue_name"])

        yield per_queue(
            gauge(
                "oldest_due_message_age_seconds",
                "Seconds since the longest-waiting due message of the queue became due (0 if none)",
            ),
            lambda q: snap.oldest_due_age.get(q, 0.0),
        )
        yield per_queue(
            gauge("dead_letters_last_hour", "Messages dead-lettered (failed) in the last hour"),
            lambda q: snap.dead_letters_last_hour.get(q, 0.0),
        )
        yield per_queue(
            CounterMetricFamily(
                f"{PREFIX}_dead_lettered",
                "Messages dead-lettered by the workers so far (counted as archived; prune does not lower it)",
                labels=["queue_name"],
            ),
            lambda q: snap.dead_lettered.get(q, 0.0),
        )
        workers = GaugeMetricFamily(
            f"{PREFIX}_live_workers", "Worker processes whose last heartbeat is within heartbeat_timeout"
        )
        workers.add_metric([], snap.live_workers)
        yield workers
        yield per_queue(
            gauge("queue_paused", "1 while the queue is paused (dramatiq-pg-outbox pause), 0 once resumed"),
            lambda q: 1.0 if q in snap.paused else 0.0,
        )
        yield per_queue(
            gauge(
                "oldest_running_message_age_seconds",
                "Seconds since the oldest claim of a message still processing in the queue (0 if none)",
            ),
            lambda q: snap.oldest_running_age.get(q, 0.0),
        )
        yield per_queue(
            gauge(
                "queue_live_workers",
                "Worker processes consuming the queue whose last heartbeat is within heartbeat_timeout",
            ),
            lambda q: snap.queue_workers.get(q, 0.0),
        )
        late = GaugeMetricFamily(
            f"{PREFIX}_schedule_lateness_seconds",
            "Seconds the next tick of an enabled schedule is overdue (0 when it is not)",
            labels=["schedule", "queue_name"],
        )
        for (schedule, queue_name), seconds in sorted(snap.schedule_lateness.items()):
            late.add_metric([schedule, queue_name], seconds)
        yield late
        if snap.read_lag is not None:
            lag_seconds = GaugeMetricFamily(
                f"{PREFIX}_read_lag_seconds",
                "Seconds the read_url's standby is behind the primary (0 when it replayed all its WAL)",
            )
            if snap.read_lag.seconds is not None:
                lag_seconds.add_metric([], snap.read_lag.seconds)
            yield lag_seconds
            lag_bytes = GaugeMetricFamily(
                f"{PREFIX}_read_lag_bytes",
                "Bytes of the primary's WAL the read_url's standby has not replayed yet",
            )
            if snap.read_lag.behind_bytes is not None:
                lag_bytes.add_metric([], snap.read_lag.behind_bytes)
            yield lag_bytes
        finished = CounterMetricFamily(
            f"{PREFIX}_messages_finished",
            "Messages moved to history so far by queue, actor and outcome (completed, retried, failed); "
            "prune does not lower it",
            labels=["queue_name", "actor_name", "state"],
        )
        # Every outcome of every (queue, actor) seen, 0 until it happens: increase() sees the first one.
        for queue_name, actor_name in actors:
            for state in FINISHED_STATES:
                finished.add_metric(
                    [queue_name, actor_name, state], snap.finished.get((queue_name, actor_name, state), 0.0)
                )
        yield finished

    @property
    def connection(self) -> psycopg.Connection[Any] | None:
        """The collector's autocommit connection to ``url``: None before the first read, or after a
        failed one."""
        return self._conn

    def close(self) -> None:
        """Close the connections (a later read opens new ones)."""
        with self._lock:
            for conn in (self._conn, self._read_conn):
                if conn is not None:
                    conn.close()
            self._conn = self._read_conn = None


class _Instruments:
    """The worker-side metric objects, created once prometheus_client knows its mode."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Histogram

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("queue_name",)) -> Any:
            return Counter(f"{PREFIX}_{name}", doc, list(labels), registry=registry)

        self.claimed = counter("claimed", "Messages claimed by this package's consumers")
        self.acked = counter("acked", "Messages acked (counted when decided, before the batched write)")
        self.nacked = counter("nacked", "Messages nacked (dead-lettered) by the consumers")
        self.requeued = counter("requeued", "Claimed messages handed back unstarted")
        self.stale = counter(
            "stale_decisions", "Acks, nacks or requeues fenced out by a newer lease when written", ()
        )
        self.rescued = counter("rescued", "Messages of dead workers released by this process's rescuer", ())
        self.quarantined = counter(
            "quarantined", "Messages of dead workers dead-lettered after max_deliveries", ()
        )
        fast = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
        self.claim_seconds = Histogram(
            f"{PREFIX}_claim_duration_seconds",
            "Time of one claim statement, seconds",
            ["queue_name"],
            buckets=fast,
            registry=registry,
        )
        self.flush_seconds = Histogram(
            f"{PREFIX}_flush_duration_seconds",
            "Time of one flush statement, seconds",
            ["statement"],
            buckets=fast,
            registry=registry,
        )


class WorkerMetrics(Middleware):
    """Dramatiq middleware: counters and histograms of this package's consumers (module docstring).

    Add it to a :class:`~dramatiq_pg_outbox.PostgresBroker`, next to Dramatiq's own
    ``Prometheus`` middleware to have both served by its exposition server::

        from dramatiq.middleware.prometheus import Prometheus
        broker.add_middleware(Prometheus())
        broker.add_middleware(WorkerMetrics())

    ``prometheus_client`` is imported when the worker process boots (after
    ``Prometheus`` has set ``PROMETHEUS_MULTIPROC_DIR``, whichever order the two were
    added in), never at import time: its multiprocess mode is fixed by that import.

    Attributes:
      registry(CollectorRegistry | None): The registry of the instruments, once booted.

    Raises:
      ImportError: At boot, if ``prometheus_client`` is missing (``pip install
        'dramatiq-pg-outbox[metrics]'``).
    """

    def __init__(self) -> None:
        self.registry: CollectorRegistry | None = None
        self._instruments: _Instruments | None = None

    def after_process_boot(self, broker: Broker) -> None:
        self.instruments(broker)

    def instruments(self, broker: Broker) -> _Instruments:
        """Create the instruments (once) and attach them to ``broker``; called at process boot."""
        if self._instruments is None:
            prometheus = next(
                (m for m in broker.middleware if type(m).__module__ == "dramatiq.middleware.prometheus"), None
            )
            if prometheus is not None and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
                from dramatiq.middleware.prometheus import DB_PATH

                os.environ["PROMETHEUS_MULTIPROC_DIR"] = DB_PATH
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry()
            self._instruments = _Instruments(self.registry)
        broker._metrics = self._instruments  # type: ignore[attr-defined]
        return self._instruments


__all__ = ["DEFAULT_CACHE_SECONDS", "STATES", "DatabaseCollector", "Snapshot", "WorkerMetrics"]
