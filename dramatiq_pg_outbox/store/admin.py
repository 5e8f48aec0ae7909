"""The operator statements: ``admin.sql`` and the ``queries.sql`` statements the operator code runs.

Used by the CLI (status, pause, resume, failed, retry-failed, maintain, schedules, migrate),
:mod:`~dramatiq_pg_outbox.partitions`, :mod:`~dramatiq_pg_outbox.metrics`,
:mod:`~dramatiq_pg_outbox.migrations` and the test servers of
:mod:`~dramatiq_pg_outbox.testing` (:class:`ServerStore`, no schema).

Rows come back as frozen dataclasses made by column name (psycopg's ``class_row``: a
column the dataclass lacks, or a field the statement does not return, raises ``TypeError``).
The schema check, the schedules and the history partitions of today are the runtime's
statements (:class:`~.messages.MessageStore`, :class:`~.periodic.PeriodicStore`).  Every
method takes the connection first and runs one statement on it: the caller owns the
connection, its transaction and any retry.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
from psycopg.rows import RowFactory, class_row

from .._queries import raw_queries, with_identifiers
from ..names import quote_ident
from .base import SchemaStore

T = TypeVar("T")


def _fetch(
    conn: psycopg.Connection[Any], factory: RowFactory[T], query: str, params: dict[str, Any] | None = None
) -> list[T]:
    with conn.cursor(row_factory=factory) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def _scalar(conn: psycopg.Connection[Any], query: str, params: dict[str, Any] | None = None) -> Any:
    """The first column of the first row, or None without a row."""
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


# -- rows -------------------------------------------------------------------
@dataclass(frozen=True)
class QueueState:
    """``status``: the live rows of one queue in one state; ``oldest_s``: age of the oldest, seconds."""

    queue_name: str
    state: str
    messages: int
    delayed: int
    oldest_s: Decimal | float | None


@dataclass(frozen=True)
class QueueDeadLetters:
    """``status``: the dead letters of one queue, in the last hour and all still in history."""

    queue_name: str
    last_hour: int
    in_history: int


@dataclass(frozen=True)
class WorkerHeartbeat:
    """``status``: a registered consumer process and the age of its heartbeat, in seconds."""

    hostname: str
    pid: int
    queues: list[str]
    heartbeat_age_s: Decimal | float


@dataclass(frozen=True)
class PausedQueue:
    """A paused queue (delay queues included) and since when (database clock)."""

    queue_name: str
    paused_at: dt.datetime


@dataclass(frozen=True)
class FailedMessage:
    """``failed``: a dead letter of ``history``."""

    id: int
    queue_name: str
    actor_name: str
    attempts: int
    finished_at: dt.datetime
    error_type: str | None
    error: str | None


@dataclass(frozen=True)
class RetriedQueue:
    """``retry_failed``: per queue, how many dead letters were moved back, and their history ids."""

    queue_name: str
    moved: int
    ids: list[int]
    #: The ``pg_notify`` column: None without a notification, else "" (``pg_notify`` returns void).
    notified: Any


@dataclass(frozen=True)
class Gauge:
    """One value of ``metrics_gauges``.

    ``kind`` is messages, oldest, running, dead, workers, queue_workers, paused,
    dead_total, schedule_late or finished.  ``queue_name`` is None for ``workers``;
    ``state`` is the message state for ``messages``, the schedule's name for
    ``schedule_late``, the outcome (completed, retried, failed) for ``finished``, else
    None.  ``actor_name`` is the actor for ``finished``, else None.
    """

    kind: str
    queue_name: str | None
    state: str | None
    value: float
    actor_name: str | None = None


@dataclass(frozen=True)
class AuditRow:
    """One operator action of the audit trail (migration 0017), newest first."""

    id: int
    at: dt.datetime
    #: The dashboard's basic-auth user or ``token``; the command line's OS user.
    operator: str
    #: ``dashboard`` or ``cli``.
    source: str
    action: str
    target: str
    count: int
    detail: str


@dataclass(frozen=True)
class LimitRow:
    """A run-time limit of concurrency keys (``concurrency_limits``, migrations 0021 and 0023)."""

    #: The queue it applies to (None: every queue).
    queue_name: str | None
    prefix: str
    max_running: int
    updated_at: dt.datetime
    #: Messages of the matching keys processing and waiting now.
    processing: int
    waiting: int


@dataclass(frozen=True)
class KeyRow:
    """A concurrency key with messages in a queue now."""

    queue_name: str
    key: str
    #: Its messages of this queue processing and waiting.
    processing: int
    waiting: int
    #: The limit the claim of this queue applies to it now.
    max_running: int
    #: The run-time limit's prefix it takes that limit from (None: the messages' own).
    limited_by: str | None
    #: The queue of that run-time limit (None: a limit of every queue, or none).
    limit_queue: str | None
    #: Its messages processing in every queue: what the claim compares with the limit.
    processing_everywhere: int


_LIMIT_ROWS = class_row(LimitRow)
_KEY_ROWS = class_row(KeyRow)


#: The actions of the audit trail (``audit.action``).
AUDIT_ACTIONS = (
    "retry",
    "discard",
    "cancel",
    "purge",
    "run-now",
    "pause",
    "resume",
    "schedule-enable",
    "schedule-disable",
    "schedule-run-now",
    "limit-set",
    "limit-unset",
)


def limit_params(*, prefix: str, queue: str | None, channel: str, notify: bool) -> dict[str, Any]:
    """The parameters of ``limit_set`` and ``limit_unset`` (shared by the sync and the dashboard's
    async store): ``queue`` None is stored as ``''``, a limit of every queue (migration 0023)."""
    return {"prefix": prefix, "queue_name": queue or "", "channel": channel, "notify": notify}


def limit_target(prefix: str, queue: str | None) -> str:
    """The audit trail's target of a change of the limit of ``prefix`` in ``queue`` (None: every queue)."""
    return prefix if queue is None else f"{prefix} in queue {queue}"


def audit_params(
    *, operator: str, source: str, action: str, target: str, count: int, detail: str = ""
) -> dict[str, Any]:
    """The parameters of ``audit_record`` (shared by the sync and the dashboard's async store).

    Raises:
      ValueError: For an action not in :data:`AUDIT_ACTIONS` (a typo would make an
        audit row nobody searches for).
    """
    if action not in AUDIT_ACTIONS:
        raise ValueError(f"unknown audit action {action!r}; one of {', '.join(AUDIT_ACTIONS)}")
    return {
        "operator": operator,
        "source": source,
        "action": action,
        "target": target,
        "count": int(count),
        "detail": detail,
    }


# -- the stores ---------------------------------------------------------------
class AdminStore(SchemaStore):
    """The operator statements on one schema (see :class:`~.base.SchemaStore`)."""

    # -- migrations ---------------------------------------------------------
    def table_exists(self, conn: psycopg.Connection[Any], *, table: str) -> bool:
        """Whether table ``table`` (unquoted) exists in the schema."""
        params = {"schema": self.schema, "table": table}
        return bool(_scalar(conn, self.queries["table_exists"], params))

    def applied_revisions(self, conn: psycopg.Connection[Any], *, version_table: str) -> list[str]:
        """The revisions recorded in alembic's ``version_table`` (unquoted) of the schema, sorted."""
        query = with_identifiers(self.queries["applied_revisions"], table=version_table)
        return [str(row[0]) for row in conn.execute(query).fetchall()]

    def create_schema_sql(self) -> str:
        """The statement that creates the schema if it does not exist yet, for alembic to run."""
        return self.queries["create_schema"]

    def set_schema_revision(self, execute: Callable[[str], Any], *, revision: int) -> None:
        """Record ``revision`` in the comment of ``messages`` by ``execute`` (alembic's ``op.execute``)."""
        execute(self.queries["set_schema_revision"].replace("{revision}", str(int(revision))))

    # -- status, pause, resume ----------------------------------------------
    def status_messages(self, conn: psycopg.Connection[Any]) -> list[QueueState]:
        """Live rows per queue and state, by queue then state."""
        return _fetch(conn, class_row(QueueState), self.queries["status_messages"])

    def status_failed(self, conn: psycopg.Connection[Any]) -> list[QueueDeadLetters]:
        """Dead letters per queue, by queue."""
        return _fetch(conn, class_row(QueueDeadLetters), self.queries["status_failed"])

    def status_workers(self, conn: psycopg.Connection[Any]) -> list[WorkerHeartbeat]:
        """The registered consumer processes, by host then pid."""
        return _fetch(conn, class_row(WorkerHeartbeat), self.queries["status_workers"])

    def paused_queues(self, conn: psycopg.Connection[Any]) -> list[PausedQueue]:
        """The paused queues (delay queues included), oldest pause first."""
        return _fetch(conn, class_row(PausedQueue), self.queries["paused_queues"])

    def record_audit(self, conn: psycopg.Connection[Any], **action: Any) -> None:
        """Write one row of the audit trail (the keywords of :func:`audit_params`)."""
        conn.execute(self.queries["audit_record"], audit_params(**action))

    def audit(self, conn: psycopg.Connection[Any], *, limit: int) -> list[AuditRow]:
        """The newest ``limit`` actions of the audit trail, newest first."""
        return _fetch(conn, class_row(AuditRow), self.queries["audit_list"], {"limit": limit})

    def known_queues(self, conn: psycopg.Connection[Any], *, queue_names: Sequence[str]) -> list[str]:
        """Those of ``queue_names`` that some message, worker, schedule or pause has named."""
        params = {"queue_names": list(queue_names)}
        return [str(row[0]) for row in conn.execute(self.queries["known_queues"], params).fetchall()]

    def pause_queues(self, conn: psycopg.Connection[Any], *, queue_names: Sequence[str]) -> list[str]:
        """Pause ``queue_names``; those that were not paused yet."""
        params = {"queue_names": list(queue_names)}
        return [str(row[0]) for row in conn.execute(self.queries["pause_queues"], params).fetchall()]

    def resume_queues(
        self, conn: psycopg.Connection[Any], *, queue_names: Sequence[str], channel: str
    ) -> list[str]:
        """Resume ``queue_names``, waking their workers on ``channel``; those that were paused."""
        params = {"queue_names": list(queue_names), "channel": channel}
        return [str(row[0]) for row in conn.execute(self.queries["resume_queues"], params).fetchall()]

    # -- concurrency limits (migrations 0021, 0023) ----------------------------
    def set_limit(
        self,
        conn: psycopg.Connection[Any],
        *,
        prefix: str,
        max_running: int,
        channel: str,
        queue: str | None = None,
        notify: bool = True,
    ) -> tuple[int | None, list[str]]:
        """Set the run-time limit of the keys starting with ``prefix`` in ``queue`` (None: in
        every queue): (the previous one, or None; the queues whose workers were woken)."""
        params = limit_params(prefix=prefix, queue=queue, channel=channel, notify=notify)
        row = conn.execute(self.queries["limit_set"], {**params, "max_running": max_running}).fetchone()
        assert row is not None
        return (None if row[0] is None else int(row[0])), [str(q) for q in row[1]]

    def unset_limit(
        self,
        conn: psycopg.Connection[Any],
        *,
        prefix: str,
        channel: str,
        queue: str | None = None,
        notify: bool = True,
    ) -> int | None:
        """Remove the run-time limit of ``prefix`` in ``queue`` (None: the one of every queue):
        the limit removed, None if there was none."""
        params = limit_params(prefix=prefix, queue=queue, channel=channel, notify=notify)
        row = conn.execute(self.queries["limit_unset"], params).fetchone()
        return None if row is None else int(row[0])

    def limits(self, conn: psycopg.Connection[Any], *, queue: str | None = None) -> list[LimitRow]:
        """The run-time limits (those that apply to ``queue``; None: all), with their keys'
        messages processing and waiting."""
        with conn.cursor(row_factory=_LIMIT_ROWS) as cur:
            return cur.execute(self.queries["limits"], {"queue_name": queue}).fetchall()

    def busiest_keys(
        self, conn: psycopg.Connection[Any], *, prefix: str | None, limit: int, queue: str | None = None
    ) -> list[KeyRow]:
        """The concurrency keys with messages, per queue (of ``queue``; None: any), the most
        waiting first (at most ``limit``)."""
        params = {"prefix": prefix, "limit": limit, "queue_name": queue}
        with conn.cursor(row_factory=_KEY_ROWS) as cur:
            return cur.execute(self.queries["busiest_keys"], params).fetchall()

    # -- dead letters -------------------------------------------------------
    def failed_list(
        self, conn: psycopg.Connection[Any], *, queue: str | None, limit: int
    ) -> list[FailedMessage]:
        """The newest ``limit`` dead letters, of ``queue`` or of all (None)."""
        params = {"queue": queue, "limit": limit}
        return _fetch(conn, class_row(FailedMessage), self.queries["failed_list"], params)

    def retry_failed(
        self,
        conn: psycopg.Connection[Any],
        *,
        ids: Sequence[int] | None,
        queue_name: str | None,
        actor_name: str | None,
        error_type: str | None,
        search: str | None,
        limit: int | None,
        notify: bool,
        channel: str,
    ) -> list[RetriedQueue]:
        """Move dead letters back to their queues, due now; per queue, by queue name.

        Selected by ``ids`` and the filters (None: any), oldest first, at most ``limit``
        (None: all); wakes their workers on ``channel`` if ``notify``.
        """
        params = {
            "ids": None if ids is None else list(ids),
            "queue_name": queue_name,
            "actor_name": actor_name,
            "error_type": error_type,
            "search": search,
            "limit": limit,
            "notify": notify,
            "channel": channel,
        }
        return _fetch(conn, class_row(RetriedQueue), self.queries["retry_failed"], params)

    # -- history partitions ---------------------------------------------------
    def default_partition_rows(self, conn: psycopg.Connection[Any]) -> int:
        """Rows in ``history_default`` (no day partition existed for them)."""
        return int(_scalar(conn, self.queries["default_partition_rows"]) or 0)

    def day_partitions(self, conn: psycopg.Connection[Any]) -> list[str]:
        """The table names of the partitions of ``history`` (day ones and ``history_default``)."""
        params = {"table": f"{quote_ident(self.schema)}.history"}
        return [str(row[0]) for row in conn.execute(self.queries["day_partitions"], params).fetchall()]

    def prune_cutoff(self, conn: psycopg.Connection[Any], *, older_than: dt.timedelta) -> dt.datetime:
        """The database clock's ``now() - older_than``."""
        cutoff: dt.datetime = _scalar(conn, self.queries["prune_cutoff"], {"older_than": older_than})
        return cutoff

    def set_lock_timeout(self, conn: psycopg.Connection[Any], *, lock_timeout_ms: int) -> None:
        """Set ``lock_timeout`` for the rest of the current transaction, in milliseconds."""
        conn.execute(self.queries["set_lock_timeout"], {"lock_timeout": str(int(lock_timeout_ms))})

    def estimated_rows(self, conn: psycopg.Connection[Any], *, table: str) -> int:
        """The planner's row estimate of table ``table`` (unquoted) of the schema; 0 if it is missing."""
        row = _scalar(conn, self.queries["estimated_rows"], {"schema": self.schema, "table": table})
        return int(row) if row is not None else 0

    def drop_partition(self, conn: psycopg.Connection[Any], *, partition: str) -> None:
        """Drop partition ``partition`` (a table name) of ``history``."""
        conn.execute(with_identifiers(self.queries["drop_partition"], partition=partition))

    def delete_history_before(
        self, conn: psycopg.Connection[Any], *, partition: str, cutoff: dt.datetime
    ) -> int:
        """Delete the rows of partition ``partition`` that finished before ``cutoff``; how many."""
        query = with_identifiers(self.queries["delete_history_before"], partition=partition)
        return conn.execute(query, {"cutoff": cutoff}).rowcount

    def count_history_before(
        self, conn: psycopg.Connection[Any], *, partition: str, cutoff: dt.datetime
    ) -> int:
        """The rows of partition ``partition`` that finished before ``cutoff``."""
        query = with_identifiers(self.queries["count_history_before"], partition=partition)
        return int(_scalar(conn, query, {"cutoff": cutoff}) or 0)

    def prune_idempotency_keys(self, conn: psycopg.Connection[Any]) -> int:
        """Free the idempotency keys no row of messages or history holds; how many."""
        return conn.execute(self.queries["prune_idempotency_keys"]).rowcount

    def count_idempotency_keys_before(self, conn: psycopg.Connection[Any], *, cutoff: dt.datetime) -> int:
        """The keys a prune at ``cutoff`` would free."""
        return int(_scalar(conn, self.queries["count_idempotency_keys_before"], {"cutoff": cutoff}) or 0)

    # -- metrics ------------------------------------------------------------
    def metrics_gauges(self, conn: psycopg.Connection[Any], *, heartbeat_timeout_ms: int) -> list[Gauge]:
        """Every Prometheus gauge of the schema; a worker counts as live within ``heartbeat_timeout_ms``."""
        params = {"heartbeat_timeout_ms": heartbeat_timeout_ms}
        return _fetch(conn, class_row(Gauge), self.queries["metrics_gauges"], params)


@dataclass(frozen=True)
class ReplicaPosition:
    """Where a server's data stands (``replica_position``): a standby's replay, or a primary.

    Attributes:
      in_recovery(bool): Whether the server is a standby (``pg_is_in_recovery()``).
      replay_lsn(str|None): The WAL position replayed (``pg_last_wal_replay_lsn()``); None on a primary.
      replayed_at(datetime|None): When the last transaction replayed committed on the primary
        (``pg_last_xact_replay_timestamp()``); None on a primary or before the first commit replayed.
      paused(bool): Whether replay is paused (``pg_wal_replay_pause()``).
      now(datetime): The server's clock.
    """

    in_recovery: bool
    replay_lsn: str | None
    replayed_at: dt.datetime | None
    paused: bool
    now: dt.datetime


@dataclass(frozen=True)
class ReadLag:
    """How far the server reads come from (a ``read_url``) is behind the primary.

    Made by :meth:`of` from the read server's :class:`ReplicaPosition` and the primary's
    answer to "how many bytes of WAL lie past that position" (None when the primary was not
    reached).  What it means:

    - ``standby`` false: the read server is not in recovery (a primary, or the same server as
      ``url``): reads see what it holds, ``seconds`` and ``behind_bytes`` are 0.
    - ``behind_bytes`` 0: the standby has replayed every byte of WAL the primary had written
      when asked: caught up, ``seconds`` is 0, however old its last replayed commit is (an
      idle primary writes no commit for the standby to replay).
    - ``behind_bytes`` > 0, or None (primary not reached): ``seconds`` is the age, on the
      read server's clock, of the last transaction it replayed (``now() -
      pg_last_xact_replay_timestamp()``): the data shown is at most that old.  Without the
      primary it cannot tell an idle primary from a lagging standby: the age of an idle
      system's last commit shows as lag.  None when no commit was replayed yet.

    Attributes:
      standby(bool): Whether the read server is in recovery.
      behind_bytes(float|None): Bytes of WAL written on the primary and not replayed yet;
        None when the primary was not reached.
      seconds(float|None): The lag in seconds by the rules above (None: unknown).
      replayed_at(datetime|None): Commit time of the last transaction replayed.
      paused(bool): Replay is paused on the standby (``pg_wal_replay_pause()``).
      primary_error(str|None): Why the primary was not reached (one line), or None.
    """

    standby: bool
    behind_bytes: float | None
    seconds: float | None
    replayed_at: dt.datetime | None = None
    paused: bool = False
    primary_error: str | None = None

    @classmethod
    def of(
        cls, position: ReplicaPosition, behind_bytes: float | None, primary_error: str | None = None
    ) -> ReadLag:
        """The lag from the read server's position and the primary's bytes past it (see the class)."""
        if not position.in_recovery:
            return cls(False, 0.0, 0.0)
        behind = None if behind_bytes is None else max(0.0, float(behind_bytes))
        seconds: float | None
        if behind == 0:
            seconds = 0.0
        elif position.replayed_at is None:
            seconds = None
        else:
            seconds = max(0.0, (position.now - position.replayed_at).total_seconds())
        return cls(True, behind, seconds, position.replayed_at, position.paused, primary_error)

    def describe(self) -> str:
        """One line for people: ``reads from a standby, 12.5 s behind the primary (4,096 bytes of WAL)``."""
        if not self.standby:
            return "Reads from the read URL's server, which is not a standby (not in recovery): no lag"
        paused = "; replay is paused" if self.paused else ""
        if self.behind_bytes is None:
            age = "unknown" if self.seconds is None else f"{self.seconds:,.1f} s ago"
            return (
                f"Reads from a standby; the primary was not reached ({self.primary_error or 'no URL'}): "
                f"its last replayed commit was {age} (an idle primary looks the same){paused}"
            )
        if self.behind_bytes == 0:
            return f"Reads from a standby, caught up with the primary{paused}"
        seconds = "an unknown time" if self.seconds is None else f"{self.seconds:,.1f} s"
        return (
            f"Reads from a standby, {seconds} behind the primary "
            f"({self.behind_bytes:,.0f} bytes of WAL not replayed){paused}"
        )

    def as_json(self) -> dict[str, Any]:
        """The fields as JSON values (times in ISO 8601), with ``describe()`` as ``text``."""
        return {
            "standby": self.standby,
            "seconds": self.seconds,
            "behind_bytes": self.behind_bytes,
            "replayed_at": None if self.replayed_at is None else self.replayed_at.isoformat(),
            "paused": self.paused,
            "primary_error": self.primary_error,
            "text": self.describe(),
        }


def read_lag(
    read_conn: psycopg.Connection[Any],
    primary_conn: psycopg.Connection[Any] | None,
    primary_error: str = "not connected",
) -> ReadLag:
    """The :class:`ReadLag` of ``read_conn``'s server behind ``primary_conn``'s (None: not reached,
    for the reason ``primary_error``).

    Reads the read server's position first, then the primary's, so the bytes behind are never
    understated.  A primary that answers with an error (a server in recovery itself) counts as
    not reached, its error as ``primary_error``.

    Raises:
      psycopg.Error: From ``read_conn``.
    """
    store = ServerStore()
    position = store.replica_position(read_conn)
    if not position.in_recovery:
        return ReadLag.of(position, 0.0)
    if primary_conn is None:
        return ReadLag.of(position, None, primary_error)
    try:
        _, behind = store.wal_position(primary_conn, replay_lsn=position.replay_lsn)
    except psycopg.Error as e:
        return ReadLag.of(position, None, " ".join(str(e).split()) or type(e).__name__)
    return ReadLag.of(position, behind)


class ServerStore:
    """The statements on a server rather than a schema: the test servers' probe and scratch databases,
    their standbys (streaming replication) and the replay position of a ``read_url``."""

    def __init__(self) -> None:
        self.queries = raw_queries()

    def ping(self, conn: psycopg.Connection[Any]) -> None:
        """Run ``SELECT 1`` (raises if the server does not answer)."""
        conn.execute(self.queries["ping"])

    def create_database(self, conn: psycopg.Connection[Any], *, name: str) -> None:
        """Create database ``name`` (on an autocommit connection)."""
        conn.execute(with_identifiers(self.queries["create_database"], database=name))

    def drop_database(self, conn: psycopg.Connection[Any], *, name: str) -> None:
        """Drop database ``name`` if it exists, closing its connections (on an autocommit connection)."""
        conn.execute(with_identifiers(self.queries["drop_database"], database=name))

    def wal_position(
        self, conn: psycopg.Connection[Any], *, replay_lsn: str | None = None
    ) -> tuple[str, float | None]:
        """On a primary: (its current WAL position, bytes of WAL past ``replay_lsn``; None without one).

        Raises:
          psycopg.errors.ObjectNotInPrerequisiteState: On a server in recovery.
        """
        row = conn.execute(self.queries["wal_position"], {"replay_lsn": replay_lsn}).fetchone()
        assert row is not None
        return str(row[0]), None if row[1] is None else float(row[1])

    def replica_position(self, conn: psycopg.Connection[Any]) -> ReplicaPosition:
        """Where the server's data stands: a standby's replay position, or a primary's (not in recovery)."""
        return _fetch(conn, class_row(ReplicaPosition), self.queries["replica_position"])[0]

    def replayed_up_to(self, conn: psycopg.Connection[Any], *, lsn: str) -> bool:
        """On a standby: whether it has replayed its primary's WAL up to ``lsn`` (``X/Y``)."""
        return bool(_scalar(conn, self.queries["replayed_up_to"], {"lsn": lsn}))

    def sync_state(self, conn: psycopg.Connection[Any], *, name: str) -> str | None:
        """On a primary: the ``sync_state`` of the standby whose ``application_name`` is ``name``; None
        while it is not connected."""
        value = _scalar(conn, self.queries["sync_state"], {"name": name})
        return None if value is None else str(value)

    def pause_replay(self, conn: psycopg.Connection[Any]) -> None:
        """On a standby: stop replaying WAL (it keeps receiving it) until :meth:`resume_replay`."""
        conn.execute(self.queries["pause_replay"])

    def resume_replay(self, conn: psycopg.Connection[Any]) -> None:
        """On a standby: replay WAL again."""
        conn.execute(self.queries["resume_replay"])


__all__ = [
    "AdminStore",
    "FailedMessage",
    "Gauge",
    "PausedQueue",
    "QueueDeadLetters",
    "QueueState",
    "ReadLag",
    "ReplicaPosition",
    "RetriedQueue",
    "ServerStore",
    "WorkerHeartbeat",
    "read_lag",
]
