"""The dashboard's database layer: one method per query of ``dashboard/queries.sql``.

Rows come back as frozen dataclasses (psycopg's ``class_row``).  Connections
come from a small ``psycopg_pool.AsyncConnectionPool`` in autocommit mode:
every read is one statement (one snapshot), every action one statement (one
transaction).  With a ``read_url`` (a hot standby), the reads take their
connections from a second pool on that server and the actions stay on the
first one, the primary's (docs/guides/configuration.md, "Reading from a standby").
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from dramatiq.common import dq_name, q_name
from psycopg.rows import class_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .._isolation import read_committed_async
from .._queries import CHANGED_ROWS_ROUNDS, DASHBOARD_SQL, file_queries
from .._queries import queries_for_schema as all_queries_for_schema
from ..options import HEARTBEAT_TIMEOUT_MS
from ..store.admin import AuditRow, KeyRow, LimitRow, ReadLag, ReplicaPosition, audit_params, limit_params
from ..urls import libpq_url

#: The oldest schema revision the dashboard reads: the analytics views of migration 0003.
MIN_SCHEMA_REVISION = 3

T = TypeVar("T")


def raw_queries() -> dict[str, str]:
    """The queries of ``dashboard/queries.sql`` by name, ``{schema}`` not yet filled in.

    Loaded by the package's one SQL loader (``_queries.py``), in a namespace of its own.

    Raises:
      ValueError: If a name is defined twice.
    """
    return file_queries(DASHBOARD_SQL)


def without_priority(query: str) -> str:
    """``query`` for a schema older than migration 0010, which has no ``priority`` columns.

    The dashboard reads schemas from revision 3 on (an upgrade window: a new
    dashboard before ``migrate``); its actions that copy rows between messages
    and history (retry, cancel) then run without that column in their lists.
    """
    return re.sub(r",\s*priority\b", "", query)


def without_slot(query: str) -> str:
    """``query`` for a schema older than migration 0013, whose ``messages`` has no ``slot`` column.

    Drops the column from the insert's list and its value (the ``CASE`` that picks
    ``messages_vacuumed`` or the ring's current partition) from the select list.
    """
    slot_value = r",\s*CASE WHEN idempotency_key IS NOT NULL THEN -1\s+ELSE \(SELECT [^)]*\)\) END"
    query = re.sub(slot_value, "", query)
    return re.sub(r",\s*slot\b", "", query)


def without_concurrency(query: str) -> str:
    """``query`` for a schema older than migration 0021, which has no concurrency key columns."""
    return re.sub(r",\s*concurrency_(?:key|limit)\b", "", query)


#: Statements of the package's namespace (``admin.sql``) that the dashboard runs too.
SHARED_QUERIES = ("audit_record", "audit_list", "replica_position", "wal_position")
#: Seconds the lag's question to the primary waits for a connection (then: primary not reached).
LAG_PRIMARY_TIMEOUT = 2.0


def queries_for_schema(schema: str) -> dict[str, str]:
    """All dashboard queries with ``{schema}`` replaced by the quoted schema name.

    Raises:
      ValueError: If ``schema`` is not a valid schema name.
    """
    return all_queries_for_schema(schema, DASHBOARD_SQL)


# -- rows -------------------------------------------------------------------
@dataclass(frozen=True)
class QueueRow:
    """A queue: live rows by state, age of its oldest due row (seconds), the last hour, dead letters."""

    queue_name: str
    pending: int
    delayed: int
    processing: int
    oldest_due_age_s: float
    completed_last_hour: int
    failed_last_hour: int
    dead_letters: int


@dataclass(frozen=True)
class QueueMinute:
    queue_name: str
    minute: dt.datetime
    n: int


@dataclass(frozen=True)
class MessageRow:
    """A live row of ``messages``; ``due_in_s`` < 0 once due.  ``payload`` only in :meth:`Store.message`."""

    id: int
    queue_name: str
    actor_name: str
    message_id: str
    state: str
    attempts: int
    enqueued_at: dt.datetime
    next_attempt_at: dt.datetime
    acquired_at: dt.datetime | None
    owner: uuid.UUID | None
    due_in_s: float
    payload: bytes | None = None
    idempotency_key: str | None = None
    #: The ``broker_priority`` it is claimed by (0: none).
    priority: int = 0
    #: The payload's first :data:`PREVIEW_HEAD_BYTES` bytes (lists of rows only).
    payload_head: bytes | None = None
    #: The whole payload's size in bytes (:meth:`Store.message` only, whose ``payload`` is
    #: its first :data:`SHOWN_PAYLOAD_BYTES` bytes).
    payload_bytes: int | None = None
    #: The payload's last :data:`TAIL_BYTES` bytes (:meth:`Store.message` only): where
    #: Dramatiq's JSON keeps ``message_timestamp`` (see :func:`message_timestamp`).
    payload_tail: bytes | None = None

    @property
    def args_preview(self) -> str:
        """The arguments, shortened (see :func:`args_preview`)."""
        return args_preview(self.payload_head)


@dataclass(frozen=True)
class WorkerRow:
    """A consumer process and its heartbeat age in seconds."""

    id: uuid.UUID
    hostname: str
    pid: int
    queues: list[str]
    started_at: dt.datetime
    heartbeat_age_s: float
    processing: int
    #: Whether it counts as alive by the store's ``heartbeat_timeout`` (the rule
    #: ``worker_alive`` of queries.sql, the one the rescuer applies).
    alive: bool


@dataclass(frozen=True)
class ScheduleRow:
    """A periodic job (``schedules``): ``next_in_s`` < 0 once its next tick is late."""

    name: str
    actor_name: str
    queue_name: str
    cron: str | None
    every_ms: int | None
    tz: str
    missed: str
    grace_ms: int
    last_run_at: dt.datetime | None
    next_run_at: dt.datetime
    next_in_s: float
    runs: int
    missed_ticks: int
    removed_at: dt.datetime | None
    disabled_at: dt.datetime | None


@dataclass(frozen=True)
class FailedRow:
    """A dead letter in the list: ``error_line`` is the last line of its traceback."""

    id: int
    queue_name: str
    actor_name: str
    message_id: str
    attempts: int
    enqueued_at: dt.datetime
    finished_at: dt.datetime
    error_type: str | None
    error_line: str
    total: int


@dataclass(frozen=True)
class ErrorTypeRow:
    actor_name: str
    error_type: str
    retried: int
    failed: int
    total: int
    rank: int


@dataclass(frozen=True)
class StatRow:
    """One actor and time bucket of ``message_stats()``; latencies in milliseconds (None: no data)."""

    actor_name: str
    bucket_start: dt.datetime
    deliveries: int
    completed: int
    retried: int
    failed: int
    throughput_per_s: float
    wait_p50_ms: float | None
    wait_p99_ms: float | None
    run_p50_ms: float | None
    run_p99_ms: float | None


@dataclass(frozen=True)
class AttemptsRow:
    actor_name: str
    attempts: int
    messages: int


@dataclass(frozen=True)
class FailedFilter:
    """The failed page's filters; ``None`` means "any"."""

    queue_name: str | None = None
    actor_name: str | None = None
    error_type: str | None = None
    search: str | None = None

    def params(self) -> dict[str, Any]:
        return {
            "queue_name": self.queue_name,
            "actor_name": self.actor_name,
            "error_type": self.error_type,
            "search": self.search,
        }


def outcome(state: str, error_type: str | None) -> str:
    """What became of a delivery: its state, but ``retried`` for a ``completed`` row with an
    error type (its actor raised and Retries enqueued it again, as ``finished_counts`` and
    ``message_stats()`` count it)."""
    return "retried" if state == "completed" and error_type else state


@dataclass(frozen=True)
class FinishedMessage:
    """A finished row of ``history`` (completed or failed) for its page.

    ``payload`` is its first :data:`SHOWN_PAYLOAD_BYTES` bytes, ``payload_bytes``
    the whole size; ``error`` the full error text (a traceback) of the delivery.
    """

    id: int
    queue_name: str
    actor_name: str
    message_id: str
    state: str
    attempts: int
    enqueued_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime
    error_type: str | None
    error: str | None
    payload: bytes
    payload_bytes: int
    idempotency_key: str | None
    priority: int = 0
    payload_tail: bytes | None = None


@dataclass(frozen=True)
class Delivery:
    """One stored delivery of a Dramatiq message (:meth:`Store.deliveries`), live or finished.

    ``state``: ``pending``/``processing`` (live) or ``completed``/``failed``; a
    ``completed`` row with an ``error_type`` is an attempt whose actor raised and
    that Retries enqueued again.  ``error_line``: the last line of its error.
    """

    id: int
    state: str
    attempts: int
    enqueued_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    error_type: str | None
    error_line: str | None
    next_attempt_at: dt.datetime | None

    @property
    def live(self) -> bool:
        return self.state in ("pending", "processing")

    @property
    def outcome(self) -> str:
        """What became of it: ``pending``, ``processing``, ``completed``, ``retried`` or ``failed``."""
        return outcome(self.state, self.error_type)


@dataclass(frozen=True)
class HistoryRow:
    """A finished row in the history list; ``payload_head`` for the arguments' preview."""

    id: int
    queue_name: str
    actor_name: str
    message_id: str
    state: str
    attempts: int
    enqueued_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime
    error_type: str | None
    error_line: str
    payload_head: bytes | None
    priority: int = 0

    @property
    def args_preview(self) -> str:
        """The arguments, shortened (see :func:`args_preview`)."""
        return args_preview(self.payload_head)

    @property
    def outcome(self) -> str:
        """``completed``, ``retried`` (its actor raised, Retries enqueued it again) or ``failed``."""
        return outcome(self.state, self.error_type)

    @property
    def cursor(self) -> str:
        """The keyset cursor of the page after this row (``HistoryFilter.before``)."""
        return f"{self.finished_at.isoformat()}_{self.id}"


@dataclass(frozen=True)
class CancelResult:
    """What a cancel did (:meth:`Store.cancel_message`).

    ``outcome`` is ``canceled`` (a waiting message, archived as canceled now),
    ``canceling`` (a running one: marked, its worker told; ``worker`` is
    ``"<host> pid <pid>"`` when its process is listed) or None: then the row was
    finished (``finished_state``, ``finished_at`` from history) or is unknown.
    """

    queue_name: str | None
    outcome: str | None
    worker: str | None = None
    finished_state: str | None = None
    finished_at: dt.datetime | None = None


@dataclass(frozen=True)
class HistoryFilter:
    """The history search; ``None`` means "any".

    Parameters:
      since(datetime): Finished at or after (aware).  Required: the days searched.
      until(datetime|None): Finished before; None: now and later.
      queue_name, actor_name(str|None): Exact names.
      state(str|None): ``completed`` or ``failed``.
      message_id(str|None): A Dramatiq message id (exact).
      args(str|None): Text the arguments must contain, as Dramatiq's ``JSONEncoder``
        writes them (:func:`args_needle`): ``cust-42`` matches the string
        ``"cust-42"`` and ``"x-cust-42"`` and the number 1342 for ``42``; in double
        quotes (``"cust-42"``) only a whole string value.  Exact and case-sensitive.
        Payloads of another encoder are not searched reliably.
      before(tuple[datetime, int]|None): The keyset cursor: rows older than this
        (finished_at, id).
    """

    since: dt.datetime
    until: dt.datetime | None = None
    queue_name: str | None = None
    actor_name: str | None = None
    state: str | None = None
    message_id: str | None = None
    args: str | None = None
    before: tuple[dt.datetime, int] | None = None

    def params(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "until": self.until or dt.datetime.max.replace(tzinfo=dt.timezone.utc),
            "queue_name": self.queue_name,
            "actor_name": self.actor_name,
            "state": self.state,
            "message_id": self.message_id,
            "needle": args_needle(self.args) if self.args else None,
            "before_at": self.before[0] if self.before else None,
            "before_id": self.before[1] if self.before else None,
        }


def parse_time(value: str, now: dt.datetime) -> dt.datetime:
    """A time of the history filters: ISO 8601 (UTC unless it names an offset) or an age back from ``now``.

    ``2026-11-27``, ``2026-11-27T10:00``, ``2026-11-27 10:00:00+01:00``; ``90m``, ``6h``, ``2d``.

    Raises:
      ValueError: Neither form, with a one-line reason.
    """
    text = value.strip()
    age = re.fullmatch(r"(\d+)\s*(s|m|min|h|d)", text)
    if age:
        unit = {"s": "seconds", "m": "minutes", "min": "minutes", "h": "hours", "d": "days"}[age.group(2)]
        return now - dt.timedelta(**{unit: int(age.group(1))})
    try:
        parsed = dt.datetime.fromisoformat(text.replace(" UTC", "").replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{value!r} is not a time: give 2026-11-27T10:00 (UTC) or an age such as 6h or 2d"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def args_needle(term: str) -> bytes:
    """The bytes a search for ``term`` looks for in a payload of Dramatiq's ``JSONEncoder``.

    That encoder writes ``json.dumps(..., separators=(",", ":"))`` (ASCII, with
    ``\\uXXXX`` escapes); the term is escaped the same way, so ``café`` and a
    term with quotes find their arguments.  A term in double quotes stands for a
    whole string value (its quotes are kept).
    """
    term = term.strip()
    if len(term) >= 2 and term[0] == term[-1] == '"':
        return json.dumps(term[1:-1]).encode()
    return json.dumps(term)[1:-1].encode()


_TIMESTAMP = re.compile(rb'"message_timestamp":(\d+)')


def message_timestamp(*parts: bytes | None) -> dt.datetime | None:
    """When a message was first enqueued (its ``message_timestamp``, which retries keep), from its payload.

    ``parts``: the payload or its first and last bytes (the field is written last
    by Dramatiq's ``JSONEncoder``).  None if not found (another encoder).
    """
    for part in parts:
        found = _TIMESTAMP.findall(part or b"")
        if found:
            return dt.datetime.fromtimestamp(int(found[-1]) / 1000, dt.timezone.utc)
    return None


def follow_ups(payload: bytes) -> dict[str, Any]:
    """What a message asks to run after it, from its options (Dramatiq's ``JSONEncoder`` only).

    Returns ``{"pipe_target": [(actor_name, message_id), ...], "on_success": str,
    "on_failure": str}``, each key present only when set: the next steps of a
    pipeline (Dramatiq stores the whole next message, and its own next one, in
    ``options.pipe_target``) and the actors of the ``Callbacks`` middleware.
    Empty for a payload that is not complete JSON.
    """
    try:
        options = json.loads(payload.decode("utf-8")).get("options") or {}
    except (UnicodeDecodeError, ValueError, AttributeError):
        return {}
    found: dict[str, Any] = {}
    target, steps = options.get("pipe_target"), list[tuple[str, str]]()
    while isinstance(target, dict) and len(steps) < 100:
        steps.append((str(target.get("actor_name")), str(target.get("message_id"))))
        target = (target.get("options") or {}).get("pipe_target")
    if steps:
        found["pipe_target"] = steps
    for name in ("on_success", "on_failure"):
        if isinstance(options.get(name), str):
            found[name] = options[name]
    return found


def result_keys(queue_name: str, actor_name: str, message_id: str, namespace: str) -> list[str]:
    """The keys Dramatiq's ``ResultBackend.build_message_key`` gives a message's result.

    Both forms: the MD5 (the default) and the readable one
    (``use_namespace_prefix_keys=True``).  Source: dramatiq/results/backend.py.
    """
    readable = f"{namespace}:{q_name(queue_name)}:{actor_name}:{message_id}"
    return [hashlib.md5(readable.encode()).hexdigest(), readable]  # Dramatiq's key, not a secret


#: Dramatiq's default results namespace (``ResultBackend(namespace=...)``).
RESULTS_NAMESPACE = "dramatiq-results"
#: Bytes of a payload's end read for its ``message_timestamp``.
TAIL_BYTES = 256
#: Longest a history search runs, in milliseconds (then the page asks for a narrower one).
HISTORY_SEARCH_TIMEOUT_MS = 15_000
#: The newest part of a history search's range read first (then windows 4 times longer).
HISTORY_FIRST_WINDOW = dt.timedelta(hours=1)
_DAY = dt.timedelta(days=1)
#: Rows of one page of the history list.
HISTORY_PAGE = 50


#: Bytes of a payload shown on its message page (64 KiB); the rest is downloaded raw.
SHOWN_PAYLOAD_BYTES = 65_536
#: Bytes of a payload read for the arguments' preview of a list (a large payload stays in the table).
PREVIEW_HEAD_BYTES = 1_024
#: Characters of that preview.
PREVIEW_CHARS = 80


def args_preview(head: bytes | None) -> str:
    """The arguments of a payload written by Dramatiq's ``JSONEncoder``, on one short line.

    ``[7, "gold"]``, then the keyword arguments if any (``{"segment": "gold"}``),
    cut at :data:`PREVIEW_CHARS` characters with an ellipsis.  Read from the payload's
    first bytes only, without parsing them as JSON (they may end mid-value).  Another
    encoder's payload (pickle, a custom one) gets an empty preview: it is never decoded,
    as on the message page (see :func:`decode_payload`).
    """
    if not head or not head.startswith(b'{"'):
        return ""
    text = head.decode("utf-8", "replace")
    start = text.find('"args":')
    if start < 0:
        return ""
    shown = text[start + len('"args":') :].split(',"options":', 1)[0]
    shown = shown.replace(',"kwargs":{}', "").replace(',"kwargs":', " ")
    return shown if len(shown) <= PREVIEW_CHARS else shown[: PREVIEW_CHARS - 1] + "\u2026"


def decode_payload(payload: bytes, size: int | None = None) -> tuple[bool, str]:
    """Show a stored payload without running it.

    Dramatiq's default ``JSONEncoder`` payloads are pretty-printed.  Anything
    else (``PickleEncoder``, a custom encoder) is shown as bytes and never
    decoded: unpickling would run code chosen by whoever wrote the row (see
    docs/security.md).  The first bytes of a larger payload (``size``: its whole
    size) are shown as they are, JSON text or bytes, after a line that says so.

    Returns:
      tuple[bool, str]: (whether it was JSON, the text to show).
    """
    if size is not None and size > len(payload):
        cut = f"The first {len(payload):,} of {size:,} bytes (download the payload for all of it):\n"
        if payload.startswith(b"{"):
            return True, cut + payload.decode("utf-8", "replace")
        return False, cut + repr(payload[:512])
    try:
        return True, json.dumps(json.loads(payload.decode("utf-8")), indent=2, sort_keys=True)
    except (UnicodeDecodeError, ValueError):
        return False, f"{len(payload)} bytes, not JSON (not decoded): {payload[:512]!r}"


def _day_before(since: dt.datetime | None) -> dt.datetime:
    """Where to start looking for a message's rows in history: a day before its timestamp
    (a producer's clock may be ahead of the database's), or the beginning of time."""
    if since is None:
        return dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    return since - dt.timedelta(days=1)


class Store:
    """The dashboard's queries on one schema, over a pool of at most ``max_size`` connections.

    Parameters:
      url(str): A PostgreSQL URL (any SQLAlchemy-style ``postgresql+driver://`` is accepted).
      schema(str): Schema of the broker tables.
      channel(str): The broker's NOTIFY channel (workers are woken after a retry).
      max_size(int): Most pooled connections.  Default 4.
      timeout(float): Longest wait for a connection, in seconds (then the page answers 503).  Default 10.
      heartbeat_timeout(int): The workers' ``heartbeat_timeout``, in milliseconds: a worker
        silent for longer counts as dead.  Default
        :data:`~dramatiq_pg_outbox.options.HEARTBEAT_TIMEOUT_MS`, the broker's default.
      read_url(str|None): A URL of a hot standby of ``url``'s server: every read (the lists,
        the pages, the charts) runs there, over a pool of its own (``max_size`` connections
        too); every action (retry, discard, cancel, purge, pause, resume, run now, limits,
        schedules, the audit trail's rows) stays on ``url``.  A server that is not in
        recovery is accepted too (:meth:`read_lag` says so).  Default None: everything on ``url``.
    """

    def __init__(
        self,
        url: str,
        schema: str,
        channel: str,
        max_size: int = 4,
        timeout: float = 10,
        *,
        heartbeat_timeout: int = HEARTBEAT_TIMEOUT_MS,
        read_url: str | None = None,
    ) -> None:
        self.schema = schema
        self.channel = channel
        self.heartbeat_timeout = heartbeat_timeout
        #: Longest a history search runs, in milliseconds (:data:`HISTORY_SEARCH_TIMEOUT_MS`).
        self.search_timeout_ms = HISTORY_SEARCH_TIMEOUT_MS
        shared = all_queries_for_schema(schema)
        # The audit trail's statements are the command line's too (admin.sql): one text for both.
        self.queries = {**queries_for_schema(schema), **{name: shared[name] for name in SHARED_QUERIES}}

        def pool(of: str, name: str) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
            return AsyncConnectionPool(
                libpq_url(of),
                min_size=1,
                max_size=max_size,
                open=False,
                kwargs={"autocommit": True, "application_name": name},
                check=AsyncConnectionPool.check_connection,
                configure=read_committed_async,
                timeout=timeout,
            )

        self.pool = pool(url, "dramatiq-pg-outbox dashboard")
        #: The pool of the reads: the standby's of ``read_url``, else the one of ``url`` (``pool``).
        self.read_pool = (
            self.pool if read_url is None else pool(read_url, "dramatiq-pg-outbox dashboard reads")
        )

    @property
    def reads_elsewhere(self) -> bool:
        """bool: Whether reads come from a ``read_url`` (a pool of their own)."""
        return self.read_pool is not self.pool

    async def open(self) -> None:
        await self.pool.open(wait=False)
        if self.reads_elsewhere:
            await self.read_pool.open(wait=False)

    async def close(self) -> None:
        if self.reads_elsewhere:
            await self.read_pool.close()
        await self.pool.close()

    async def read_lag(self) -> ReadLag | None:
        """How far the reads' server is behind the primary; None without a ``read_url``.

        Asks the read server where its replay stands, then the primary (waiting
        :data:`LAG_PRIMARY_TIMEOUT` seconds at most for a connection) how many bytes of WAL it
        has written past that: :class:`~dramatiq_pg_outbox.store.admin.ReadLag` says what the
        figures mean (0 s when caught up, whatever the age of the last commit).

        Raises:
          psycopg.Error, psycopg_pool.PoolTimeout: From the read server.
        """
        if not self.reads_elsewhere:
            return None
        async with self.read_pool.connection() as conn:
            async with conn.cursor(row_factory=class_row(ReplicaPosition)) as replica:
                await replica.execute(self.queries["replica_position"])
                position = await replica.fetchone()
        assert position is not None
        if not position.in_recovery:
            return ReadLag.of(position, 0.0)
        try:
            async with self.pool.connection(timeout=LAG_PRIMARY_TIMEOUT) as conn:
                cur = await conn.execute(self.queries["wal_position"], {"replay_lsn": position.replay_lsn})
                row = await cur.fetchone()
        except (psycopg.Error, PoolTimeout) as e:
            return ReadLag.of(position, None, " ".join(str(e).split()) or type(e).__name__)
        assert row is not None
        return ReadLag.of(position, row[1])

    async def _rows(self, cls: type[T], name: str, params: dict[str, Any] | None = None) -> list[T]:
        async with self.read_pool.connection() as conn:
            async with conn.cursor(row_factory=class_row(cls)) as cur:
                await cur.execute(self.queries[name], params or {})
                return await cur.fetchall()

    async def _rows_any_revision(self, cls: type[T], name: str, params: dict[str, Any]) -> list[T]:
        """:meth:`_rows`, without the ``priority`` column on a schema older than migration 0010."""
        async with self.read_pool.connection() as conn:
            async with conn.cursor(row_factory=class_row(cls)) as cur:
                try:
                    await cur.execute(self.queries[name], params)
                except psycopg.errors.UndefinedColumn:
                    await cur.execute(without_priority(self.queries[name]), params)
                return await cur.fetchall()

    async def _tuples(self, name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run an action (on the primary, ``url``); its rows, if it returns any."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self.queries[name], params or {})
            return await cur.fetchall() if cur.description else []

    async def _read_tuples(self, name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run a read (on ``read_url`` if given); its rows."""
        async with self.read_pool.connection() as conn:
            cur = await conn.execute(self.queries[name], params or {})
            return await cur.fetchall() if cur.description else []

    # -- reads --------------------------------------------------------------
    async def ping(self) -> None:
        await self._read_tuples("clock")

    async def now(self) -> dt.datetime:
        rows = await self._read_tuples("clock")
        value: dt.datetime = rows[0][0]
        return value

    async def queues(self) -> list[QueueRow]:
        return await self._rows(QueueRow, "queues")

    async def queue_minutes(self) -> list[QueueMinute]:
        return await self._rows(QueueMinute, "queue_minutes")

    async def queue_messages(
        self,
        queue_name: str,
        limit: int,
        offset: int = 0,
        actor_name: str | None = None,
        status: str | None = None,
    ) -> list[MessageRow]:
        """A page of a queue's live rows; ``status``: ``due``, ``delayed``, ``processing`` or None (any)."""
        params = {
            "queue_name": queue_name,
            "limit": limit,
            "offset": offset,
            "actor_name": actor_name,
            "status": status,
            "head_bytes": PREVIEW_HEAD_BYTES,
        }
        return await self._rows_any_revision(MessageRow, "queue_messages", params)

    async def queue_actors(self, queue_name: str) -> list[str]:
        return [str(row[0]) for row in await self._read_tuples("queue_actors", {"queue_name": queue_name})]

    async def running(self) -> dict[uuid.UUID, list[int]] | None:
        """Row ids each live worker process runs now; None on a schema older than migration 0011."""
        try:
            rows = await self._read_tuples("running", {"heartbeat_timeout_ms": self.heartbeat_timeout})
        except psycopg.errors.UndefinedColumn:
            return None
        return {worker: list(ids) for worker, ids in rows}

    async def message(self, row_id: int) -> MessageRow | None:
        """One live row, with the first :data:`SHOWN_PAYLOAD_BYTES` bytes of its payload; None if gone."""
        params = {"id": row_id, "shown_bytes": SHOWN_PAYLOAD_BYTES, "tail_bytes": TAIL_BYTES}
        rows = await self._rows_any_revision(MessageRow, "message", params)
        return rows[0] if rows else None

    async def message_payload(self, row_id: int) -> bytes | None:
        """The whole payload of a live row (the raw download); None if the row is gone."""
        rows = await self._read_tuples("message_payload", {"id": row_id})
        return bytes(rows[0][0]) if rows else None

    async def finished_message(self, row_id: int) -> FinishedMessage | None:
        """One finished row (history), its payload cut as :meth:`message`'s; None if not there."""
        params = {"id": row_id, "shown_bytes": SHOWN_PAYLOAD_BYTES, "tail_bytes": TAIL_BYTES}
        rows = await self._rows_any_revision(FinishedMessage, "finished_message", params)
        return rows[0] if rows else None

    async def finished_payload(self, row_id: int) -> bytes | None:
        """The whole payload of a finished row (the raw download); None if it is not in history."""
        rows = await self._read_tuples("finished_payload", {"id": row_id})
        return bytes(rows[0][0]) if rows else None

    async def deliveries(self, message_id: str, since: dt.datetime | None) -> list[Delivery]:
        """Every stored delivery of one Dramatiq message, oldest first (at most 1,000).

        ``since``: the message's first enqueue (:func:`message_timestamp`); history is
        read from the day before it on (None: all of it, slow on a long history).
        """
        return await self._rows(
            Delivery, "message_deliveries", {"message_id": message_id, "since": _day_before(since)}
        )

    async def find_message(self, message_id: str, since: dt.datetime | None = None) -> int | None:
        """The id of the newest row, live or finished (from the day before ``since``), of a message id."""
        params = {"message_id": message_id, "since": _day_before(since)}
        rows = await self._read_tuples("find_message", params)
        return int(rows[0][0]) if rows else None

    async def message_result(
        self, queue_name: str, actor_name: str, message_id: str, namespace: str = RESULTS_NAMESPACE
    ) -> bytes | None:
        """The result a results backend of ``namespace`` stored for a message; None if none (or expired)."""
        keys = result_keys(queue_name, actor_name, message_id, namespace)
        try:
            rows = await self._read_tuples("message_results", {"keys": keys})
        except psycopg.errors.UndefinedTable:  # before migration 0004
            return None
        return bytes(rows[0][1]) if rows else None

    async def history(self, where: HistoryFilter, limit: int = HISTORY_PAGE) -> list[HistoryRow]:
        """One page of finished rows, newest first (see the ``history`` statement for the plan).

        The range is read newest first in windows that grow fourfold (the last
        :data:`HISTORY_FIRST_WINDOW`, then the 4 times longer one before it, ...) until the
        page is full or the range is read: the newest page of a busy history reads its
        last hour only (through the BRIN index on ``finished_at``, rows being appended in
        that order), a rare match reads the whole range, about as one statement would.
        A search by arguments or message id starts with a day (a partition, one
        sequential scan: a search of one day is one statement).

        Raises:
          psycopg.errors.QueryCanceled: The search ran longer than ``search_timeout_ms``
            in all (default :data:`HISTORY_SEARCH_TIMEOUT_MS`; narrow the time range or
            name the actor).
        """
        params = {**where.params(), "limit": limit, "head_bytes": PREVIEW_HEAD_BYTES}
        since: dt.datetime = params["since"]
        upper: dt.datetime = params["until"]
        if where.before is not None:
            upper = min(upper, where.before[0] + dt.timedelta(microseconds=1))
        query = self.queries["history"]
        rows: list[HistoryRow] = []
        started = time.monotonic()
        async with self.read_pool.connection() as conn, conn.transaction():
            now = (await (await conn.execute(self.queries["clock"])).fetchone() or [None])[0]
            # A search for arguments or a message id matches few rows: whole days at a time
            # (a day is a partition, read in one sequential scan); otherwise the last hour first.
            window = HISTORY_FIRST_WINDOW if where.args is None and where.message_id is None else _DAY
            lower = max(since, min(upper, now) - window)
            async with conn.cursor(row_factory=class_row(HistoryRow)) as cur:
                while True:
                    left_ms = self.search_timeout_ms - (time.monotonic() - started) * 1000
                    if self.search_timeout_ms and left_ms <= 0:
                        raise psycopg.errors.QueryCanceled("the history search ran out of time")
                    timeout = max(1, int(left_ms)) if self.search_timeout_ms else 0
                    await conn.execute(self.queries["search_timeout"], {"ms": timeout})
                    step = {**params, "since": lower, "until": upper, "limit": limit - len(rows)}
                    try:
                        async with conn.transaction():
                            await cur.execute(query, step)
                    except psycopg.errors.UndefinedColumn:  # before migration 0010: no priority
                        query = without_priority(query)
                        await cur.execute(query, step)
                    rows += await cur.fetchall()
                    if len(rows) >= limit or lower <= since:
                        return rows
                    window *= 4
                    upper, lower = lower, max(since, lower - window)

    async def workers(self) -> list[WorkerRow]:
        return await self._rows(WorkerRow, "workers", {"heartbeat_timeout_ms": self.heartbeat_timeout})

    async def failed(self, where: FailedFilter, limit: int, offset: int) -> list[FailedRow]:
        return await self._rows(FailedRow, "failed", {**where.params(), "limit": limit, "offset": offset})

    async def failed_queues(self) -> list[str]:
        return [row[0] for row in await self._read_tuples("failed_queues")]

    async def error_types(self) -> list[ErrorTypeRow]:
        return await self._rows(ErrorTypeRow, "error_types")

    async def message_stats(self, bucket: dt.timedelta, since: dt.datetime) -> list[StatRow]:
        return await self._rows(StatRow, "message_stats", {"bucket": bucket, "since": since})

    async def message_attempts(self) -> list[AttemptsRow]:
        return await self._rows(AttemptsRow, "message_attempts")

    # -- actions ------------------------------------------------------------
    async def retry_failed(self, ids: Sequence[int] | None, where: FailedFilter) -> dict[str, int]:
        """Move dead letters back to their queues (fresh attempts, due now); count per queue.

        ``ids`` None selects by ``where`` alone (all fields None: every dead letter).
        """
        params = {
            "ids": list(ids) if ids is not None else None,
            "channel": self.channel,
            "notify": True,
            "limit": None,
            **where.params(),
        }
        # The broker's statement, shared with the CLI's retry-failed (one behaviour).
        rows = await self._copying(all_queries_for_schema(self.schema)["retry_failed"], params)
        return {queue_name: int(n) for queue_name, n, _, _ in rows}

    async def _copying(self, query: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run an action that copies rows between messages and history, on any readable revision."""
        async with self.pool.connection() as conn:
            # The newest schema first, then without migration 0021's concurrency keys, 0013's
            # slot, then 0010's priority.
            older = without_concurrency(query)
            for variant in (query, older, without_slot(older)):
                try:
                    cur = await conn.execute(variant, params)
                    return await cur.fetchall()
                except psycopg.errors.UndefinedColumn:
                    continue
            cur = await conn.execute(without_priority(without_slot(older)), params)
            return await cur.fetchall()

    async def paused_queues(self) -> dict[str, dt.datetime]:
        """The paused queues and since when; empty on a schema older than migration 0009."""
        try:
            async with self.read_pool.connection() as conn:
                cur = await conn.execute(all_queries_for_schema(self.schema)["paused_queues"])
                rows = await cur.fetchall()
        except psycopg.errors.UndefinedTable:
            return {}
        return {str(q): at for q, at in rows if q == q_name(q)}

    async def pause_queue(self, queue_name: str) -> bool:
        """Pause a queue and its delay queue (the CLI's statement); whether it was running."""
        params = {"queue_names": [queue_name, dq_name(queue_name)]}
        async with self.pool.connection() as conn:
            cur = await conn.execute(all_queries_for_schema(self.schema)["pause_queues"], params)
            return bool(await cur.fetchall())

    async def resume_queue(self, queue_name: str) -> bool:
        """Resume a queue and its delay queue, waking their workers; whether it was paused."""
        params = {"queue_names": [queue_name, dq_name(queue_name)], "channel": self.channel}
        async with self.pool.connection() as conn:
            cur = await conn.execute(all_queries_for_schema(self.schema)["resume_queues"], params)
            return bool(await cur.fetchall())

    async def purge_queue(self, queue_name: str) -> int:
        """Delete the waiting rows of a queue; returns how many.

        Runs again for the rows its statement saw waiting but did not delete: a row that
        the reclaimer moved to another partition meanwhile is deleted where it went.
        """
        params: dict[str, Any] = {"queue_name": queue_name, "ids": None}
        purged = 0
        for _ in range(CHANGED_ROWS_ROUNDS):
            rows = await self._tuples("purge_queue", params)
            purged += int(rows[0][0])
            params["ids"] = rows[0][1]
            if not params["ids"]:
                break
        return purged

    async def run_now(self, row_id: int) -> str | None:
        """Make a delayed row due now and wake its workers; its queue, or None if it was not delayed.

        Runs again while its statement saw the row delayed but did not update it (moved by
        the reclaimer, see :meth:`purge_queue`).
        """
        for _ in range(CHANGED_ROWS_ROUNDS):
            ((queue_name, seen),) = await self._tuples("run_now", {"id": row_id, "channel": self.channel})
            if queue_name is not None or not seen:
                return None if queue_name is None else str(queue_name)
        return None

    async def discard_failed(self, ids: Sequence[int] | None, where: FailedFilter) -> dict[str, int]:
        """Delete dead letters (by ``ids``, or by ``where`` when None); the count per queue."""
        params = {"ids": list(ids) if ids is not None else None, **where.params()}
        return {str(q): int(n) for q, n in await self._tuples("discard_failed", params)}

    async def schedules(self) -> list[ScheduleRow] | None:
        """The periodic jobs; None on a schema older than migration 0011 (no enable/disable)."""
        try:
            return await self._rows(ScheduleRow, "schedules")
        except (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedTable):
            return None

    # -- concurrency limits (migrations 0021, 0023; the CLI's statements) --------
    async def limits(self) -> list[LimitRow]:
        """The run-time limits of concurrency keys, with their keys' messages processing and waiting."""
        async with self.read_pool.connection() as conn:
            async with conn.cursor(row_factory=class_row(LimitRow)) as cur:
                await cur.execute(all_queries_for_schema(self.schema)["limits"], {"queue_name": None})
                return await cur.fetchall()

    async def busiest_keys(self, prefix: str | None, limit: int, queue: str | None = None) -> list[KeyRow]:
        """The concurrency keys with messages, per queue (of ``queue``; None: any), the most
        waiting first (at most ``limit``)."""
        params = {"prefix": prefix, "limit": limit, "queue_name": queue}
        async with self.read_pool.connection() as conn:
            async with conn.cursor(row_factory=class_row(KeyRow)) as cur:
                await cur.execute(all_queries_for_schema(self.schema)["busiest_keys"], params)
                return await cur.fetchall()

    async def set_limit(self, prefix: str, max_running: int, queue: str | None = None) -> int | None:
        """Set the run-time limit of the keys starting with ``prefix`` in ``queue`` (None: every
        queue), waking the workers of the queues concerned with keyed messages waiting; the
        previous limit (None: there was none)."""
        params = limit_params(prefix=prefix, queue=queue, channel=self.channel, notify=True)
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                all_queries_for_schema(self.schema)["limit_set"], {**params, "max_running": max_running}
            )
            row = await cur.fetchone()
        return None if row is None or row[0] is None else int(row[0])

    async def unset_limit(self, prefix: str, queue: str | None = None) -> int | None:
        """Remove the run-time limit of ``prefix`` in ``queue`` (None: the one of every queue);
        the limit removed (None: there was none)."""
        params = limit_params(prefix=prefix, queue=queue, channel=self.channel, notify=True)
        async with self.pool.connection() as conn:
            cur = await conn.execute(all_queries_for_schema(self.schema)["limit_unset"], params)
            row = await cur.fetchone()
        return None if row is None else int(row[0])

    async def record_audit(self, **action: Any) -> bool:
        """Write one row of the audit trail (the keywords of ``audit_params``); False before 0017."""
        try:
            await self._tuples("audit_record", audit_params(**action))
        except psycopg.errors.UndefinedTable:
            return False
        return True

    async def audit(self, limit: int) -> list[AuditRow] | None:
        """The newest ``limit`` operator actions; None on a schema older than migration 0017."""
        try:
            return await self._rows(AuditRow, "audit_list", {"limit": limit})
        except psycopg.errors.UndefinedTable:
            return None

    async def run_schedule_now(self, name: str) -> bool:
        """Make a schedule's next tick due now (a scheduler enqueues it); whether it changed.

        False for a disabled, removed or unknown schedule, or one whose tick is due already.
        """
        return bool(await self._tuples("run_schedule_now", {"name": name}))

    async def set_schedule_enabled(self, name: str, enabled: bool) -> bool:
        """Enable or disable a schedule; whether it changed."""
        return bool(await self._tuples("set_schedule_enabled", {"name": name, "enabled": enabled}))

    async def cancel_message(self, row_id: int, reason: str) -> CancelResult:
        """Cancel a message: a waiting one now, a running one through its worker (see the statement).

        A waiting row moves to history as ``canceled`` (error type ``Canceled``, ``reason``
        its error); a running one is marked and its worker told (``cancel:<row id>`` on the
        broker channel), which interrupts the actor and archives it as ``canceled``.
        Runs again while its statement saw the row but changed nothing (claimed or moved by
        the reclaimer meanwhile, see :meth:`purge_queue`).

        Parameters:
          row_id(int): The row id of the message (``messages.id``).
          reason(str): Stored as the canceled row's error (who and when).

        Returns:
          CancelResult: What was done, or where the row was found (finished, or gone).
        """
        for _ in range(CHANGED_ROWS_ROUNDS):
            ((queue_name, outcome, worker, seen, finished_state, finished_at),) = await self._tuples(
                "cancel_message", {"id": row_id, "reason": reason, "channel": self.channel}
            )
            if outcome is not None or not seen:
                break
        return CancelResult(
            queue_name=queue_name,
            outcome=outcome,
            worker=worker,
            finished_state=finished_state,
            finished_at=finished_at,
        )
