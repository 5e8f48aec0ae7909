"""What a :class:`~dramatiq_pg_outbox.PostgresBroker` opens in one process.

One ``_Runtime`` per broker per process (a fork gets a fresh one): the
connection pool, and three background loops in River's maintenance-service
shape (config from the broker, a ticker, a ``run_once``-style method that
returns counts and is testable without threads):

- ``_Flusher``: buffers ack/nack/requeue decisions from worker threads
  (lock-free ``deque.append``) and writes each kind with one set-based
  statement every ``flush_interval`` ms or when ``flush_batch_size`` is
  reached; failed writes are kept and retried with backoff.  The batch
  completer of River is the model.
- ``_Maintenance``: heartbeats this process's ``workers`` row and runs the
  release-stuck (rescue) and orphan checks.
- ``_Listener``: one LISTEN connection per process, shared by all consumers;
  a notification only wakes consumers early, correctness never depends on it.

Connections per consuming process: ``pool_size`` (pool) + 1 (listener).
"""

from __future__ import annotations

import os
import random
import select
import socket
import threading
import time
import traceback
import uuid
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.common import compute_backoff
from dramatiq.logging import get_logger
from psycopg import sql
from psycopg_pool import ConnectionPool

from ._queries import queries_for_schema
from .errors import SchemaNotReady, translate_errors
from .migrations import SCHEMA_REVISION, parse_schema_revision, quote_ident

if TYPE_CHECKING:
    from dramatiq import Message

    from .broker import PostgresBroker, _PostgresConsumer

#: Claims younger than this are never treated as orphans, in milliseconds.
ORPHAN_GRACE_MS = 30_000
#: Longest text of a dead-lettered message's error that is stored, in characters.
MAX_ERROR_CHARS = 8_000


@dataclass(frozen=True)
class RescueResult:
    """Counts from one release-stuck pass."""

    released: int
    quarantined: int
    dead_workers: int


def format_error(exc: BaseException | None) -> tuple[str, str]:
    """(type name, traceback text clipped to ``MAX_ERROR_CHARS``) of a failed message's exception."""
    if exc is None:
        return "Unknown", "the message failed without an exception (for example, it was skipped)"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS // 2] + "\n[...]\n" + text[-MAX_ERROR_CHARS // 2 :]
    return type(exc).__name__, text


class _Runtime:
    def __init__(self, broker: PostgresBroker) -> None:
        self.logger = get_logger(__name__, type(self))
        self.broker = broker
        self.pid = os.getpid()
        self.queries = queries_for_schema(broker.schema)
        self.channel = broker.channel
        self.worker_id = uuid.uuid4()
        self.pool = ConnectionPool(
            broker.conninfo,
            min_size=1,
            max_size=broker.pool_size,
            # The application name tells operators (pg_stat_activity) which
            # process holds which connection: "dramatiq-pg-outbox:<pid>".
            kwargs={"autocommit": True, "application_name": f"dramatiq-pg-outbox:{self.pid}"},
            timeout=broker.pool_timeout / 1000,
            name=f"dramatiq-pg-outbox-{self.pid}",
            open=False,
        )
        self.pool.open(wait=False)
        # Reentrant: register() heartbeats, and the heartbeat reads queue_names().
        self._lock = threading.RLock()
        self._schema_ok = not broker.check_schema
        self.consumers: dict[str, set[_PostgresConsumer]] = defaultdict(set)
        #: Claims this process holds: row id -> lease.  Removed once the
        #: flusher has written the message's outcome.
        self.inflight: dict[int, uuid.UUID] = {}
        self.flusher = _Flusher(self)
        self.maintenance: _Maintenance | None = None
        self.listener: _Listener | None = None
        self.closed = False

    # -- connections --------------------------------------------------------
    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection; connection errors become Dramatiq's."""
        with translate_errors():
            conn = self._getconn()
            try:
                if not self._schema_ok:
                    self._check_schema(conn)
                yield conn
            finally:
                self.pool.putconn(conn)

    def _getconn(self) -> psycopg.Connection[Any]:
        # An idle pooled connection with unread input has been told something
        # by the server, typically "terminating connection" (a restart,
        # pg_terminate_backend, an idle timeout).  Check those before use and
        # replace the dead ones, so a statement is never sent on them: no
        # spurious ConnectionClosed after a server-side disconnect.  Healthy
        # idle connections have nothing to read and cost no round trip.
        for _ in range(self.broker.pool_size + 1):
            conn = self.pool.getconn()
            readable, _, _ = (
                select.select([conn.fileno()], [], [], 0) if not conn.closed else ([True], [], [])
            )
            if not readable:
                return conn
            try:
                ConnectionPool.check_connection(conn)
                return conn
            except psycopg.Error:
                conn.close()
                self.pool.putconn(conn)
        return self.pool.getconn()

    def execute(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        with self.connection() as conn:
            cur = conn.execute(self.queries[name], params)
            return cur.fetchall() if cur.description else []

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        table = f"{quote_ident(self.broker.schema)}.messages"
        exists, comment = conn.execute(self.queries["schema_revision"], {"table": table}).fetchone() or (
            False,
            None,
        )
        revision = parse_schema_revision(comment)
        fix = f"dramatiq-pg-outbox migrate --url <DATABASE_URL> --schema {self.broker.schema}"
        if not exists:
            raise SchemaNotReady(
                f"The dramatiq-pg-outbox tables do not exist in schema {self.broker.schema!r} "
                f"of {self.broker.safe_url}. Run: {fix}"
            )
        if revision is None or revision < SCHEMA_REVISION:
            raise SchemaNotReady(
                f"The dramatiq-pg-outbox schema {self.broker.schema!r} is at revision {revision}, "
                f"this version needs {SCHEMA_REVISION}. Run: {fix}"
            )
        self._schema_ok = True

    # -- producing ----------------------------------------------------------
    def enqueue(self, items: Sequence[tuple[Message[Any], int]], *, notify: bool) -> None:
        with self.connection() as conn:
            name, params = enqueue_statement(items, self.channel, notify)
            conn.execute(self.queries[name], params)

    # -- consuming ----------------------------------------------------------
    def register(self, consumer: _PostgresConsumer) -> None:
        with self._lock:
            self.consumers[consumer.queue_name].add(consumer)
            if self.maintenance is None:
                maintenance = _Maintenance(self)
                # The workers row must exist before this process claims anything: a rescue
                # pass elsewhere releases the claims of an owner it has no heartbeat from.
                try:
                    maintenance.heartbeat()
                except BaseException:
                    self.consumers[consumer.queue_name].discard(consumer)
                    raise
                self.maintenance = maintenance
                self.maintenance.start()
            if self.listener is None and self.broker.listen:
                self.listener = _Listener(self)
                self.listener.start()

    def unregister(self, consumer: _PostgresConsumer) -> None:
        with self._lock:
            self.consumers[consumer.queue_name].discard(consumer)

    def queue_names(self) -> list[str]:
        with self._lock:
            return sorted(name for name, group in self.consumers.items() if group)

    def wake(self, queue_name: str | None) -> None:
        """Wake the consumers of ``queue_name`` (all consumers for ``None``)."""
        with self._lock:
            groups = list(self.consumers.values()) if queue_name is None else [self.consumers.get(queue_name)]
            targets = [c for group in groups if group for c in group]
        for consumer in targets:
            consumer.notify()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for loop in (self.listener, self.maintenance):
            if loop is not None:
                loop.stop()
        self.flusher.stop()
        if self.maintenance is not None:
            try:
                self.execute("unregister_worker", {"id": self.worker_id})
            except Exception as e:
                self.logger.warning("Could not unregister worker %s: %s", self.worker_id, e)
        self.pool.close(timeout=5)


def enqueue_params(items: Sequence[tuple[Message[Any], int]], channel: str, notify: bool) -> dict[str, Any]:
    """Parameters of the ``enqueue`` query for ``(message, delay in ms)`` pairs."""
    return {
        "queue_names": [m.queue_name for m, _ in items],
        "actor_names": [m.actor_name for m, _ in items],
        "message_ids": [m.message_id for m, _ in items],
        "delays": [d for _, d in items],
        "payloads": [m.encode() for m, _ in items],
        "idempotency_keys": [idempotency_key(m) for m, _ in items],
        "channel": channel,
        "notify": notify,
    }


def enqueue_query_name(params: dict[str, Any]) -> str:
    """``enqueue``, or the cheaper ``enqueue_unkeyed`` when no message of the batch has an idempotency key."""
    return "enqueue" if any(k is not None for k in params["idempotency_keys"]) else "enqueue_unkeyed"


def enqueue_statement(
    items: Sequence[tuple[Message[Any], int]], channel: str, notify: bool
) -> tuple[str, dict[str, Any]]:
    """(query name, parameters) that store ``(message, delay in ms)`` pairs.

    One message without an idempotency key takes ``enqueue_one`` (scalar
    parameters); other batches take ``enqueue`` or ``enqueue_unkeyed``.
    """
    if len(items) == 1 and idempotency_key(items[0][0]) is None:
        message, delay = items[0]
        return "enqueue_one", {
            "queue_name": message.queue_name,
            "actor_name": message.actor_name,
            "message_id": message.message_id,
            "delay": delay,
            "payload": message.encode(),
            "channel": channel,
            "notify": notify,
        }
    params = enqueue_params(items, channel, notify)
    return enqueue_query_name(params), params


def idempotency_key(message: Message[Any]) -> str | None:
    """The key that makes ``message`` unique in the queue tables, or None.

    It is the ``idempotency_key`` option (``actor.send_with_options(...,
    idempotency_key="...")``), for a first enqueue only: a retry that the
    Retries middleware enqueues carries the same options (``retries`` >= 1) but
    is the same message again, so it is stored without a key.

    Raises:
      ValueError: If the option is not a non-empty string.
    """
    key = message.options.get("idempotency_key")
    if key is None or message.options.get("retries"):
        return None
    if not isinstance(key, str) or not key:
        raise ValueError(f"idempotency_key must be a non-empty string, not {key!r}")
    return key


class _Loop:
    """A daemon thread that calls ``tick()`` every ``interval`` seconds until stopped."""

    name = "loop"

    def __init__(self, runtime: _Runtime, interval: float) -> None:
        self.logger = get_logger(__name__, type(self))
        self.runtime = runtime
        self.interval = interval
        self._stop = threading.Event()
        #: Set after each successful tick.
        self.ticked = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dramatiq-pg-outbox-{self.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.tick()
                failures = 0
                delay = self.interval
                # Test signal (River-style): tests wait for it instead of sleeping.
                self.ticked.set()
            except Exception as e:
                failures += 1
                _, backoff_ms = compute_backoff(failures, factor=100, max_backoff=int(self.interval * 1000))
                delay = backoff_ms / 1000
                self.logger.warning(
                    "%s failed (attempt %d), retrying in %.2fs: %s", self.name, failures, delay, e
                )
            self._stop.wait(delay)

    def tick(self) -> None:
        raise NotImplementedError


class _Flusher:
    def __init__(self, runtime: _Runtime) -> None:
        self.logger = get_logger(__name__, type(self))
        self.runtime = runtime
        self.acks: deque[tuple[int, uuid.UUID]] = deque()
        self.nacks: deque[tuple[int, uuid.UUID, str, str]] = deque()
        self.failed_acks: deque[tuple[int, uuid.UUID, str, str]] = deque()
        self.requeues: deque[tuple[int, uuid.UUID]] = deque()
        self.notifications: deque[str] = deque()
        self.stats = {"acked": 0, "nacked": 0, "requeued": 0, "stale": 0}
        self._wake = threading.Event()
        self._urgent = threading.Event()
        self._stopping = threading.Event()
        self._flush_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    # Called from worker threads: lock-free appends, then a cheap signal.
    def ack(self, row_id: int, lease: uuid.UUID) -> None:
        self.acks.append((row_id, lease))
        self._signal(len(self.acks))

    def nack(self, row_id: int, lease: uuid.UUID, error_type: str, error: str) -> None:
        self.nacks.append((row_id, lease, error_type, error))
        self._signal(len(self.nacks))

    def ack_with_error(self, row_id: int, lease: uuid.UUID, error_type: str, error: str) -> None:
        self.failed_acks.append((row_id, lease, error_type, error))
        self._signal(len(self.failed_acks))

    def requeue(self, rows: Sequence[tuple[int, uuid.UUID]]) -> None:
        self.requeues.extend(rows)
        self._urgent.set()
        self._signal(len(self.requeues))

    def requeue_now(self, rows: Sequence[tuple[int, uuid.UUID]]) -> None:
        """Requeue and flush at once; if the database is unreachable, the flush loop retries."""
        self.requeue(rows)
        try:
            self.flush_once()
        except Exception as e:
            self.logger.warning("Requeue of %d message(s) deferred to the flush loop: %s", len(rows), e)

    def notify_later(self, queue_names: Sequence[str]) -> None:
        self.notifications.extend(queue_names)
        self._urgent.set()
        self._signal(1)

    def _signal(self, size: int) -> None:
        if self._thread is None:
            self._start()
        if size >= self.runtime.broker.flush_batch_size:
            self._urgent.set()
        if not self._wake.is_set():
            self._wake.set()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dramatiq-pg-outbox-flush", daemon=True
                )
                self._thread.start()

    def pending(self) -> int:
        buffers = (self.acks, self.nacks, self.failed_acks, self.requeues, self.notifications)
        return sum(len(b) for b in buffers)

    def _run(self) -> None:
        interval = self.runtime.broker.flush_interval / 1000
        failures = 0
        while True:
            self._wake.wait()
            if self._stopping.is_set():
                return
            self._urgent.wait(interval)
            self._wake.clear()
            self._urgent.clear()
            try:
                self.flush_once()
                failures = 0
            except Exception as e:
                failures += 1
                _, backoff_ms = compute_backoff(failures, factor=50, max_backoff=5_000)
                self.logger.warning(
                    "Flush failed (attempt %d), %d decisions kept for retry in %dms: %s",
                    failures,
                    self.pending(),
                    backoff_ms,
                    e,
                )
                self._wake.set()
                if self._stopping.wait(backoff_ms / 1000):
                    return

    def flush_once(self) -> dict[str, int]:
        """Write everything buffered; on failure the undone part is put back and the error re-raised.

        Returns:
          dict[str, int]: How many acks, nacks, requeues were written and how many were stale.
        """
        with self._flush_lock:
            return self._flush_locked()

    def _flush_locked(self) -> dict[str, int]:
        done = {"acked": 0, "nacked": 0, "requeued": 0, "stale": 0}
        batch = self.runtime.broker.flush_batch_size
        kinds: tuple[tuple[str, deque[Any]], ...] = (
            ("requeue", self.requeues),
            ("ack", self.acks),
            ("ack_with_error", self.failed_acks),
            ("nack", self.nacks),
        )
        for name, buffer in kinds:
            while buffer:
                items: list[Any] = [buffer.popleft() for _ in range(min(len(buffer), batch))]
                try:
                    written, woken = self._write(name, items)
                except Exception:
                    buffer.extendleft(reversed(items))
                    raise
                for item in items:
                    self.runtime.inflight.pop(item[0], None)
                stale = len(items) - written
                key = {"ack": "acked", "ack_with_error": "acked", "nack": "nacked", "requeue": "requeued"}[
                    name
                ]
                done[key] += written
                done["stale"] += stale
                if stale:
                    self.logger.warning(
                        "%d stale %s(s) ignored: their lease expired and the message was released "
                        "(it will be, or was, delivered again)",
                        stale,
                        name,
                    )
                for queue_name in woken:
                    self.runtime.wake(queue_name)
        if self.notifications:
            queues = sorted({self.notifications.popleft() for _ in range(len(self.notifications))})
            try:
                self.runtime.execute("notify", {"channel": self.runtime.channel, "queue_names": queues})
            except Exception:
                self.notifications.extend(queues)
                raise
        for key, value in done.items():
            self.stats[key] += value
        return done

    def _write(self, name: str, items: list[Any]) -> tuple[int, list[str]]:
        ids = [item[0] for item in items]
        leases = [item[1] for item in items]
        params: dict[str, Any] = {"ids": ids, "leases": leases}
        query = name
        if name == "requeue":
            params["notify"] = self.runtime.broker.notify != "off"
            params["channel"] = self.runtime.channel
        elif name in ("nack", "ack_with_error"):
            query = "archive"
            params["state"] = "failed" if name == "nack" else "completed"
            params["error_types"] = [item[2] for item in items]
            params["errors"] = [item[3] for item in items]
        with self.runtime.connection() as conn:
            cur = conn.execute(self.runtime.queries[query], params)
            if name != "requeue":
                return cur.rowcount, []
            rows = cur.fetchall()
            return sum(int(n) for _, n, _ in rows), [str(q) for q, _, _ in rows]

    def stop(self, timeout: float = 10.0) -> None:
        """Final flush (retried until ``timeout`` seconds), then stop the thread."""
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            try:
                self.flush_once()
            except Exception as e:
                self.logger.warning("Final flush failed, retrying: %s", e)
                time.sleep(0.2)
        if self.pending():
            self.logger.error(
                "%d ack/nack/requeue decisions could not be written before shutdown; "
                "those messages will be released by the rescuer and delivered again",
                self.pending(),
            )
        self._stopping.set()
        self._wake.set()
        self._urgent.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


class _Maintenance(_Loop):
    name = "maintenance"

    def __init__(self, runtime: _Runtime) -> None:
        super().__init__(runtime, runtime.broker.heartbeat_interval / 1000)
        self.hostname = socket.gethostname()
        self._next_rescue = 0.0

    def tick(self) -> None:
        self.heartbeat()
        now = time.monotonic()
        if now >= self._next_rescue:
            # Jitter spreads the rescuers of many processes over the interval.
            interval = self.runtime.broker.rescue_interval / 1000
            self._next_rescue = now + interval * random.uniform(0.8, 1.2)
            result = self.rescue()
            if result.released or result.quarantined:
                self.logger.warning(
                    "Released %d message(s) of dead workers; quarantined %d after max_deliveries=%d",
                    result.released,
                    result.quarantined,
                    self.runtime.broker.max_deliveries,
                )
            orphans = self.release_orphans()
            if orphans:
                self.logger.warning("Released %d orphaned claim(s) of this process", orphans)

    def heartbeat(self) -> None:
        """Insert or refresh this process's ``workers`` row."""
        self.runtime.execute(
            "heartbeat",
            {
                "id": self.runtime.worker_id,
                "hostname": self.hostname,
                "pid": os.getpid(),
                "queues": self.runtime.queue_names(),
            },
        )

    def rescue(self) -> RescueResult:
        """Release (or quarantine) processing messages whose worker stopped heartbeating."""
        broker = self.runtime.broker
        rows = self.runtime.execute(
            "rescue",
            {
                "heartbeat_timeout_ms": broker.heartbeat_timeout,
                "max_lease_ms": broker.max_lease,
                "max_deliveries": broker.max_deliveries,
                "channel": self.runtime.channel,
            },
        )
        released, quarantined, dead, _ = rows[0]
        return RescueResult(int(released), int(quarantined), int(dead))

    def release_orphans(self, grace_ms: int = ORPHAN_GRACE_MS) -> int:
        """Release rows this process holds in the database but no longer in memory."""
        known = list(self.runtime.inflight.copy())
        rows = self.runtime.execute(
            "release_orphans", {"owner": self.runtime.worker_id, "grace_ms": grace_ms, "known_ids": known}
        )
        return int(rows[0][0])


class _Listener(_Loop):
    name = "listener"

    def __init__(self, runtime: _Runtime) -> None:
        super().__init__(runtime, 0.5)
        self.connected = threading.Event()
        self.received = 0

    def tick(self) -> None:
        conn = psycopg.connect(
            self.runtime.broker.conninfo,
            autocommit=True,
            application_name=f"dramatiq-pg-outbox:{os.getpid()}:listen",
        )
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.runtime.channel)))
            self.connected.set()
            # Anything sent while we were not listening was missed: poll now.
            self.runtime.wake(None)
            while not self._stop.is_set():
                for note in conn.notifies(timeout=self.interval):
                    self.received += 1
                    self.runtime.wake(note.payload)
        finally:
            self.connected.clear()
            conn.close()
