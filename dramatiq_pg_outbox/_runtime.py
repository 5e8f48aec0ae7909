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

import math
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from dramatiq.common import compute_backoff
from dramatiq.logging import get_logger
from psycopg_pool import ConnectionPool, PoolTimeout

from ._queries import queries_for_schema, with_identifiers
from .errors import ConnectionRejected, describe_rejection, translate_errors
from .migrations import check_schema

if TYPE_CHECKING:
    from dramatiq import Message


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
    def pool_size(self) -> int: ...
    @property
    def pool_timeout(self) -> int: ...
    @property
    def max_deliveries(self) -> int: ...
    @property
    def max_fetch_interval(self) -> int: ...
    @property
    def flush_interval(self) -> int: ...
    @property
    def flush_batch_size(self) -> int: ...
    @property
    def heartbeat_interval(self) -> int: ...
    @property
    def heartbeat_timeout(self) -> int: ...
    @property
    def rescue_interval(self) -> int: ...
    @property
    def max_lease(self) -> int | None: ...
    @property
    def notify(self) -> str: ...
    @property
    def listen(self) -> bool: ...
    @property
    def check_schema(self) -> bool: ...
    @property
    def _metrics(self) -> Any: ...

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None: ...


class Wakeable(Protocol):
    """A consumer as the runtime sees it: woken by notifications (``_PostgresConsumer``)."""

    @property
    def queue_name(self) -> str: ...

    def notify(self) -> None: ...

    def notify_due(self, due_ms: int, at: float) -> None: ...

    def close(self) -> None: ...


#: Claims younger than this are never treated as orphans, in milliseconds.
ORPHAN_GRACE_MS = 30_000
#: Seconds between two calls of create_history_partitions by a maintenance loop (jittered +-20%).
PARTITIONS_INTERVAL_S = 3_600
#: Days of history partitions a maintenance loop keeps ahead (today is day 0).
PARTITIONS_DAYS_AHEAD = 7
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


#: conninfo -> why the server refused the latest connection attempt of this process to it, when
#: retrying cannot help (see errors.rejection_reason); cleared by a successful connection.
_rejected: dict[str, str] = {}


class _PoolConnection(psycopg.Connection[Any]):
    """The pool's connections: a refusal that retrying cannot fix is recorded for ``_Runtime._checkout``.

    psycopg_pool retries failed connection attempts in the background and
    only logs them; a caller waiting for a connection would learn nothing
    before ``pool_timeout``.
    """

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> _PoolConnection:
        try:
            conn = super().connect(conninfo, **kwargs)
        except psycopg.OperationalError as e:
            reason = describe_rejection(e, conninfo)
            if reason is not None:
                _rejected[conninfo] = reason
            raise
        _rejected.pop(conninfo, None)
        return conn


class _Runtime:
    def __init__(self, broker: RuntimeHost) -> None:
        self.logger = get_logger(__name__, type(self))
        self.broker = broker
        self.pid = os.getpid()
        self.queries = queries_for_schema(broker.schema)
        self.channel = broker.channel
        self.worker_id = uuid.uuid4()
        _rejected.pop(broker.conninfo, None)
        self.pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            broker.conninfo,
            connection_class=_PoolConnection,
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
        self.consumers: dict[str, set[Wakeable]] = defaultdict(set)
        #: Claims this process holds: row id -> lease.  Removed once the
        #: flusher has written the outcome of that lease (see untrack).
        self.inflight: dict[int, uuid.UUID] = {}
        self._inflight_lock = threading.Lock()
        #: Database clock minus this process's time.monotonic(), in milliseconds,
        #: as seen by the latest claim (see observe_clock); until then, the wall clock's.
        self.clock_offset_ms = (time.time() - time.monotonic()) * 1000
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
            conn = self._checkout()
            if not _has_input(conn):
                return conn
            try:
                ConnectionPool.check_connection(conn)
                return conn
            except psycopg.Error:
                conn.close()
                self.pool.putconn(conn)
        return self._checkout()

    def _checkout(self) -> psycopg.Connection[Any]:
        """A connection from the pool within ``pool_timeout``; fail at once on a refusal retries cannot fix.

        Raises:
          ConnectionRejected: The server refused a connection attempt for good (password,
            role, database, pg_hba.conf): raised as soon as the pool's attempt failed.
          psycopg_pool.PoolTimeout: No connection within ``pool_timeout``.
        """
        conninfo = self.broker.conninfo
        deadline = time.monotonic() + self.broker.pool_timeout / 1000
        step = 0.05
        while True:
            reason = _rejected.get(conninfo)
            if reason is not None:
                raise ConnectionRejected(reason)
            remaining = deadline - time.monotonic()
            try:
                # Short waits while the pool has no connection, so that a refusal recorded
                # meanwhile is seen within 50 ms; a pool whose connections are all busy is
                # waited on for the rest of pool_timeout, in its queue.
                return self.pool.getconn(timeout=max(0.001, min(remaining, step)))
            except PoolTimeout:
                if time.monotonic() >= deadline:
                    raise
                if self.pool.get_stats().get("pool_size", 0) > 0:
                    step = remaining

    def execute(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run query ``name`` on a pooled autocommit connection; its rows (``[]`` if none)."""
        with self.connection() as conn:
            cur = conn.execute(self.queries[name], params)
            return cur.fetchall() if cur.description else []

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        check_schema(conn, self.broker.schema, url=self.broker.safe_url)
        self._schema_ok = True

    # -- producing ----------------------------------------------------------
    def enqueue(self, items: Sequence[StoredMessage], *, notify: bool) -> list[StoredMessage]:
        """Store ``items`` with one statement (one commit) on the pool.

        Returns:
          list[StoredMessage]: Those actually stored (not idempotency duplicates).
        """
        name, params = enqueue_statement(items, self.channel, notify, self.broker.max_fetch_interval)
        with self.connection() as conn:
            rows = conn.execute(self.queries[name], params).fetchall()
        return enqueue_result(name, items, rows).stored

    # -- consuming ----------------------------------------------------------
    def register(self, consumer: Wakeable) -> None:
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

    def unregister(self, consumer: Wakeable) -> None:
        with self._lock:
            self.consumers[consumer.queue_name].discard(consumer)

    def queue_names(self) -> list[str]:
        with self._lock:
            return sorted(name for name, group in self.consumers.items() if group)

    def wake(self, queue_name: str | None, due_ms: int | None = None) -> None:
        """Wake the consumers of ``queue_name`` (all consumers for ``None``).

        Parameters:
          queue_name(str|None): The queue whose consumers claim.
          due_ms(int|None): Claim at this time (epoch milliseconds, database
            clock) instead of now: a delayed message falls due then.  It can
            only move a consumer's next claim earlier.
        """
        with self._lock:
            groups = list(self.consumers.values()) if queue_name is None else [self.consumers.get(queue_name)]
            targets = [c for group in groups if group for c in group]
        if due_ms is None:
            for consumer in targets:
                consumer.notify()
            return
        # The payload's due time is floored to the millisecond: +1 never wakes early.
        at = (due_ms + 1 - self.clock_offset_ms) / 1000
        for consumer in targets:
            consumer.notify_due(due_ms, at)

    def notified(self, payload: str) -> None:
        """Wake consumers for one notification of the broker channel (see parse_notification)."""
        queue_name, due_ms = parse_notification(payload)
        self.wake(queue_name, due_ms)

    def observe_clock(self, db_now_ms: float, sent: float) -> None:
        """Record the database clock seen by a statement sent at ``sent`` (``time.monotonic()``).

        The offset includes the one-way latency of that statement, so a claim
        sent at ``due - offset`` on this clock reaches the server at ``due``.
        """
        self.clock_offset_ms = db_now_ms - sent * 1000

    def track(self, rows: Sequence[tuple[Any, ...]], lease: uuid.UUID) -> None:
        """Record the claim of ``rows`` (row id first) under ``lease``."""
        with self._inflight_lock:
            for row in rows:
                self.inflight[row[0]] = lease

    def untrack(self, items: Sequence[tuple[Any, ...]]) -> None:
        """Forget claims whose outcome was written: ``(row id, lease, ...)`` items.

        Only an entry with that same lease goes: after a stale decision, the
        entry may belong to a newer claim of the same row by this process.
        """
        with self._inflight_lock:
            for item in items:
                if self.inflight.get(item[0]) == item[1]:
                    del self.inflight[item[0]]

    def known_claims(self) -> list[int]:
        """Row ids of the claims this process holds."""
        with self._inflight_lock:
            return list(self.inflight)

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


@dataclass
class Outcome:
    """The end of one delivery and what its middleware sent or stored meanwhile.

    Written by the flusher in one transaction, fenced by the lease: the ack or
    nack of row ``row_id``, then ``messages`` (a retry, the next pipeline step,
    a callback) and ``statements`` (a result) for that row only if the fence
    held.  Either all of it commits or none does and the message is delivered
    again (see docs/guarantees.md, "Follow-ups belong to the ack").
    """

    row_id: int
    lease: uuid.UUID
    #: ``"ack"``, ``"ack_with_error"`` (the actor raised and Dramatiq acked) or ``"nack"``.
    kind: str
    error_type: str | None = None
    error: str | None = None
    #: Messages enqueued while the outcome was decided, in their stored form.
    messages: list[StoredMessage] = field(default_factory=list)
    #: Other writes of that phase, (statement, parameters): results of PostgresBackend.
    statements: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def fence(self) -> tuple[int, uuid.UUID, str | None, str | None]:
        """(row id, lease, error type, error), the item form of the plain decision buffers."""
        return self.row_id, self.lease, self.error_type, self.error


@dataclass(frozen=True)
class StoredMessage:
    """A message in the form it is written: encoded and keyed when it is sent.

    Encoding at ``send()`` time means an encoding error is raised by ``send()``
    itself, and arguments mutated after ``send()`` are not what gets stored.
    """

    #: The message (on its canonical queue, without Dramatiq's ``eta``).
    message: Message[Any]
    #: Minimum delay before delivery, in milliseconds.
    delay: int
    #: ``message.encode()``: what the workers will decode.
    payload: bytes
    #: The idempotency key (see :func:`idempotency_key`), or None.
    key: str | None

    @classmethod
    def of(cls, message: Message[Any], delay: int = 0) -> StoredMessage:
        """Encode ``message`` now.

        Raises:
          ValueError: If its ``idempotency_key`` option is not a non-empty string.
          Exception: Whatever the broker's encoder raises for unencodable arguments.
        """
        key = idempotency_key(message)
        return cls(message, delay, message.encode(), key)


def enqueue_statement(
    items: Sequence[StoredMessage], channel: str, notify: bool, notify_within: int, return_ids: bool = False
) -> tuple[str, dict[str, Any]]:
    """(query name, parameters) that store ``items`` in one statement.

    One message without an idempotency key takes ``enqueue_one`` (scalar
    parameters); other batches take ``enqueue``, or the cheaper
    ``enqueue_unkeyed`` when no message has an idempotency key.  ``notify``
    says whether the statement itself calls ``pg_notify``; ``notify_within``
    (ms): delayed messages due within it are announced as ``queue@due``;
    ``return_ids``: the statement also returns the ids of the rows it inserted.
    Read the result with :func:`enqueue_result`.
    """
    if len(items) == 1 and items[0].key is None:
        item = items[0]
        return "enqueue_one", {
            "queue_name": item.message.queue_name,
            "actor_name": item.message.actor_name,
            "message_id": item.message.message_id,
            "delay": item.delay,
            "payload": item.payload,
            "channel": channel,
            "notify": notify,
            "notify_within": notify_within,
            "return_ids": return_ids,
        }
    keys = [item.key for item in items]
    params = {
        "queue_names": [item.message.queue_name for item in items],
        "actor_names": [item.message.actor_name for item in items],
        "message_ids": [item.message.message_id for item in items],
        "delays": [item.delay for item in items],
        "payloads": [item.payload for item in items],
        "channel": channel,
        "notify": notify,
        "notify_within": notify_within,
        "return_ids": return_ids,
    }
    if any(key is not None for key in keys):
        params["idempotency_keys"] = keys
        return "enqueue", params
    return "enqueue_unkeyed", params


@dataclass
class EnqueueResult:
    """What one enqueue statement did (see :func:`enqueue_result`)."""

    #: The messages actually stored: all but idempotency duplicates.
    stored: list[StoredMessage]
    #: NOTIFY payloads the statement sent, or would have sent with ``notify`` on.
    payloads: list[str]
    #: (row id, message id) of each inserted row, when asked for with ``return_ids``.
    ids: list[tuple[int, str]]


def enqueue_result(name: str, items: Sequence[StoredMessage], rows: Sequence[Sequence[Any]]) -> EnqueueResult:
    """Read the rows of an enqueue statement (columns: payload, notified, key, id, message_id).

    Every message is stored except, for ``enqueue``, those whose idempotency
    key was already taken (the statement returns the keys it inserted; of two
    messages with one key in a batch, the first is stored).
    """
    payloads = [str(row[0]) for row in rows if row[0] is not None]
    ids = [(int(row[3]), str(row[4])) for row in rows if row[3] is not None]
    if name != "enqueue":
        return EnqueueResult(list(items), payloads, ids)
    inserted_keys = {row[2] for row in rows if row[2] is not None}
    stored = []
    for item in items:
        if item.key is None:
            stored.append(item)
        elif item.key in inserted_keys:
            inserted_keys.discard(item.key)
            stored.append(item)
    return EnqueueResult(stored, payloads, ids)


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


def _has_input(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle pooled connection is closed or has unread input, without a round trip.

    ``poll()``: ``select()`` raises ``ValueError`` for a descriptor >= 1024.
    psycopg_pool's ``check_connection`` costs a round trip per checkout
    (~120 us here; +20-35 % on a ``send()`` outside a transaction, measured).
    """
    if conn.closed:
        return True
    if not hasattr(select, "poll"):  # Windows: select() has no descriptor-number limit there
        return bool(select.select([conn.fileno()], [], [], 0)[0])
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def parse_notification(payload: str) -> tuple[str, int | None]:
    """(queue name, due time or None) of a broker channel notification.

    ``"<queue>"``: a message of that queue is due now.  ``"<queue>@<due>"``:
    a delayed message falls due at ``<due>``, epoch milliseconds on the
    database clock.  Queue names never contain ``@``; a malformed due time
    counts as "now" (an early claim costs a round trip, never a message).
    """
    queue_name, at, due = payload.partition("@")
    if not at:
        return payload, None
    try:
        return queue_name, int(due)
    except ValueError:
        return queue_name, None


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
        #: Decisions with follow-ups, each written with them in one transaction.
        self.outcomes: deque[Outcome] = deque()
        self.notifications: deque[str] = deque()
        #: (transaction id, payload): sent once that transaction committed.
        self.commit_notifications: deque[tuple[str, str]] = deque()
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

    def finish(
        self,
        row_id: int,
        lease: uuid.UUID,
        kind: str,
        error_type: str | None = None,
        error: str | None = None,
        messages: list[StoredMessage] | None = None,
        statements: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> None:
        """Buffer the end of a delivery (``kind``: ``ack``, ``ack_with_error``, ``nack``).

        With follow-ups (``messages``, ``statements``) it is written with them in
        one transaction (see :class:`Outcome`); without, with the other decisions
        of its kind in one statement.
        """
        if messages or statements:
            self.outcomes.append(
                Outcome(row_id, lease, kind, error_type, error, messages or [], statements or [])
            )
            self._signal(len(self.outcomes))
        elif kind == "ack":
            self.ack(row_id, lease)
        else:
            assert error_type is not None and error is not None
            if kind == "ack_with_error":
                self.ack_with_error(row_id, lease, error_type, error)
            else:
                self.nack(row_id, lease, error_type, error)

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

    def notify_later(self, payloads: Sequence[str]) -> None:
        """Send these NOTIFY payloads soon, from the broker's own connection."""
        self.notifications.extend(payloads)
        self._urgent.set()
        self._signal(1)

    def notify_after_commit(self, xid: str, payloads: Sequence[str]) -> None:
        """Send these NOTIFY payloads once transaction ``xid`` has committed (never if it aborts)."""
        self.commit_notifications.extend((xid, p) for p in payloads)
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
        buffers = (self.acks, self.nacks, self.failed_acks, self.requeues, self.outcomes, self.notifications)
        return sum(len(b) for b in buffers)

    def _run(self) -> None:
        interval = self.runtime.broker.flush_interval / 1000
        failures = 0
        while True:
            self._wake.wait()
            self._urgent.wait(interval)
            self._wake.clear()
            self._urgent.clear()
            # Checked after the clears: stop() sets _stopping before waking us,
            # so a stop that lands during the waits is never cleared away.
            if self._stopping.is_set():
                return
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
                started = time.monotonic()
                try:
                    written, woken = self._write(name, items)
                except Exception:
                    buffer.extendleft(reversed(items))
                    raise
                metrics = self.runtime.broker._metrics
                if metrics is not None:
                    metrics.flush_seconds.labels(name).observe(time.monotonic() - started)
                    if len(items) > written:
                        metrics.stale.inc(len(items) - written)
                self.runtime.untrack(items)
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
        while self.outcomes:
            outcomes = [self.outcomes.popleft() for _ in range(min(len(self.outcomes), batch))]
            try:
                finished = self._write_outcomes(outcomes)
            except Exception:
                self.outcomes.extendleft(reversed(outcomes))
                raise
            self.runtime.untrack([o.fence() for o in outcomes])
            done["acked"] += sum(o.kind != "nack" for o in finished)
            done["nacked"] += sum(o.kind == "nack" for o in finished)
            if len(outcomes) > len(finished):
                done["stale"] += len(outcomes) - len(finished)
                self.logger.warning(
                    "%d stale decision(s) with follow-ups ignored, follow-ups included: their lease "
                    "expired and the message was released (it will be, or was, delivered again)",
                    len(outcomes) - len(finished),
                )
        if self.notifications:
            queues = sorted({self.notifications.popleft() for _ in range(len(self.notifications))})
            try:
                self.runtime.execute("notify", {"channel": self.runtime.channel, "queue_names": queues})
            except Exception:
                self.notifications.extend(queues)
                raise
        if self.commit_notifications:
            self._notify_committed()
        for key, value in done.items():
            self.stats[key] += value
        return done

    def _notify_committed(self) -> None:
        pairs = [self.commit_notifications.popleft() for _ in range(len(self.commit_notifications))]
        params = {
            "channel": self.runtime.channel,
            "xids": [xid for xid, _ in pairs],
            "payloads": [payload for _, payload in pairs],
        }
        try:
            rows = self.runtime.execute("notify_committed", params)
        except Exception:
            self.commit_notifications.extendleft(reversed(pairs))
            raise
        waiting = [(str(xid), str(payload)) for xid, payload, status in rows if status == "in progress"]
        if waiting:
            # Its COMMIT is on its way: look again at the next flush.
            self.commit_notifications.extend(waiting)
            self._wake.set()

    def _statement(self, name: str, items: Sequence[Any]) -> tuple[str, dict[str, Any]]:
        """(SQL, parameters) of one fenced decision statement for ``(row id, lease, ...)`` items."""
        params: dict[str, Any] = {"ids": [item[0] for item in items], "leases": [item[1] for item in items]}
        query = name
        if name == "requeue":
            params["notify"] = self.runtime.broker.notify != "off"
            params["channel"] = self.runtime.channel
        elif name in ("nack", "ack_with_error"):
            query = "archive"
            params["state"] = "failed" if name == "nack" else "completed"
            params["error_types"] = [item[2] for item in items]
            params["errors"] = [item[3] for item in items]
        return self.runtime.queries[query], params

    def _write(self, name: str, items: list[Any]) -> tuple[int, list[str]]:
        query, params = self._statement(name, items)
        with self.runtime.connection() as conn:
            cur = conn.execute(query, params)
            if name != "requeue":
                return cur.rowcount, []
            rows = cur.fetchall()
            return sum(int(n) for _, n, _ in rows), [str(q) for q, _, _ in rows]

    def _write_outcomes(self, outcomes: list[Outcome]) -> list[Outcome]:
        """Write decisions and their follow-ups in one transaction; the outcomes whose fence held.

        The fenced ack/archive statements return the ids they archived; only
        those rows' follow-ups are written.  A stale decision (its message was
        released and will run again) takes its follow-ups with it, so they are
        written once, by the delivery that is acked.  ``after_enqueue`` runs for
        the stored follow-ups once the transaction has committed.
        """
        runtime = self.runtime
        broker = runtime.broker
        with runtime.connection() as conn, conn.transaction():
            archived: set[int] = set()
            for kind in ("ack", "ack_with_error", "nack"):
                group = [o.fence() for o in outcomes if o.kind == kind]
                if group:
                    query, params = self._statement(kind, group)
                    archived.update(int(row[0]) for row in conn.execute(query, params).fetchall())
            written = [o for o in outcomes if o.row_id in archived]
            messages = [m for o in written for m in o.messages]
            stored: list[StoredMessage] = []
            if messages:
                name, params = enqueue_statement(
                    messages, runtime.channel, broker.notify != "off", broker.max_fetch_interval
                )
                rows = conn.execute(runtime.queries[name], params).fetchall()
                stored = enqueue_result(name, messages, rows).stored
            # Results: one executemany per statement text (psycopg pipelines it), not a
            # round trip per message.
            statements: dict[str, list[dict[str, Any]]] = {}
            for outcome in written:
                for query, params in outcome.statements:
                    statements.setdefault(query, []).append(params)
            for query, many in statements.items():
                conn.cursor().executemany(query, many)
        for item in stored:
            broker.emit_after("enqueue", item.message, item.delay or None)
        return written

    def stop(self, timeout: float = 10.0) -> None:
        """Final flush (retried until ``timeout`` seconds), then stop the thread."""
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            try:
                self.flush_once()
            except Exception as e:
                self.logger.warning("Final flush failed, retrying: %s", e)
                time.sleep(0.2)
        # Wake-ups waiting for a COMMIT in flight get a short grace (they are only wake-ups).
        grace = min(deadline, time.monotonic() + 1.0)
        while self.commit_notifications and time.monotonic() < grace:
            try:
                self.flush_once()
            except Exception:
                break
            if self.commit_notifications:
                time.sleep(0.01)
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
        self._next_partitions = 0.0
        #: time.monotonic() from which this process may judge others dead (see tick).
        self._rescue_from = 0.0
        #: time.monotonic() of the last heartbeat of this process (the runtime heartbeats before
        #: it starts this loop).
        self._beat_at = time.monotonic()

    def tick(self) -> None:
        self.heartbeat()
        now = time.monotonic()
        broker = self.runtime.broker
        if now - self._beat_at > 2 * broker.heartbeat_interval / 1000:
            # Its own heartbeat was late (the database was out of reach, or slow to answer): the
            # others' heartbeats are probably stale for the same reason, not because they died.
            # Judge nobody before they have had a full heartbeat_timeout to heartbeat again;
            # otherwise the first process back releases the running messages of the others
            # (146 duplicates without this in `python -m benchmarks.chaos --quick --scenarios 9`, 0 with it).
            self._rescue_from = now + broker.heartbeat_timeout / 1000
        self._beat_at = now
        if now < self._rescue_from:
            return
        if now >= self._next_partitions:
            self._next_partitions = now + PARTITIONS_INTERVAL_S * random.uniform(0.8, 1.2)
            self.create_partitions()
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

    def create_partitions(self) -> int:
        """Create the history partitions of the next days (at start, then about hourly).

        Without EXECUTE on the function (a worker role not granted it), says so once and
        stops trying: rows then land in ``history_default`` until an operator runs
        ``dramatiq-pg-outbox maintain``; nothing is lost.
        """
        try:
            rows = self.runtime.execute("create_history_partitions", {"days": PARTITIONS_DAYS_AHEAD})
        except psycopg.errors.InsufficientPrivilege:
            self._next_partitions = math.inf
            self.logger.warning(
                "This role may not create history partitions: archived rows go to history_default. "
                "GRANT EXECUTE ON FUNCTION %s.create_history_partitions TO this role (docs/security.md), "
                "or run 'dramatiq-pg-outbox maintain' daily as the owner",
                self.runtime.broker.schema,
            )
            return 0
        return int(rows[0][0])

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
        metrics = broker._metrics
        if metrics is not None and (released or quarantined):
            metrics.rescued.inc(int(released))
            metrics.quarantined.inc(int(quarantined))
        return RescueResult(int(released), int(quarantined), int(dead))

    def release_orphans(self, grace_ms: int = ORPHAN_GRACE_MS) -> int:
        """Release rows this process holds in the database but no longer in memory."""
        known = self.runtime.known_claims()
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
            conn.execute(with_identifiers(self.runtime.queries["listen"], channel=self.runtime.channel))
            self.connected.set()
            # Anything sent while we were not listening was missed: poll now.
            self.runtime.wake(None)
            while not self._stop.is_set():
                for note in conn.notifies(timeout=self.interval):
                    self.received += 1
                    self.runtime.notified(note.payload)
        finally:
            self.connected.clear()
            conn.close()
