"""The messages store: every statement of ``queries.sql`` that the broker's runtime runs.

Enqueue (the broker's ``send()``, the flusher's follow-ups, the outboxes), the claim and
the consumer's rank, the fenced decisions (ack, archive, requeue), wake-ups, the
maintenance loop's heartbeat, rescue and orphans, the reclaimer, a queue's size and purge,
the schema check.  :class:`MessageStore` fills the schema in once; each method takes the
connection first (the caller's: a pooled autocommit connection, or one in a transaction)
and returns typed rows.

The rows of the hot path (the claim, the fenced archives, the enqueue) are
:class:`~typing.NamedTuple` classes built by :func:`named_rows`, a row factory that
costs one C call per row (``tuple.__new__``), no Python frame.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import psycopg
from psycopg.types.numeric import Int8

from .._queries import raw_queries, with_identifiers
from ..names import quote_ident
from .base import SchemaStore, named_rows
from .libpq import BIGINT, BOOLEAN, BYTEA, SMALLINT, TEXT, Numbered, execute_and_commit

#: Upcoming delayed rows a claim reads at most to find its consumer's next due time
#: (``look_ahead`` of ``claim``).
LOOK_AHEAD = 64


def _bigint(value: int) -> Int8:
    """``value`` sent as ``bigint`` whatever its size (the claims' integers).

    psycopg types a Python ``int`` by its size (smallint, integer, bigint, and so their
    arrays) and keys its prepared statements by their parameters' types: a claim whose
    watermark id or limit crossed 32,767 was a statement of its own, prepared and planned
    again (see :meth:`MessageStore.warm_claims`).
    """
    return Int8(value)


def _array_literal(values: Sequence[object]) -> str:
    """The text of a PostgreSQL array of ``values``, ``"{1,2,3}"``, for a ``%(x)s::bigint[]``
    or ``::text[]`` parameter.

    Only for values whose text needs no quoting in an array literal: integers, and the
    fences ``"<row id>/<lease>"`` (digits, ``/``, hexadecimal digits and ``-``).  psycopg's
    dumper of a Python list dumps it element by element in Python: 5.1% of a draining
    worker's samples that held the GIL (CPython 3.11, psycopg 3.3), where this join is
    one C call per array (benchmarks/README.md section 30).

    Parameters:
      values(Sequence[int | str]): The elements, none needing quotes.

    Returns:
      str: The array literal.
    """
    return "{" + ",".join(map(str, values)) + "}"


#: The names of the enqueue statements (see :class:`EnqueueStatement`).
ENQUEUE_STATEMENTS = frozenset({"enqueue", "enqueue_unkeyed", "enqueue_one"})


class Cursor(Protocol):
    """A DB-API cursor: psycopg's, Django's, or an adapter of SQLAlchemy's ``exec_driver_sql``.

    For the statements that an application's own connection runs (the outboxes).
    """

    def execute(self, query: str, params: Mapping[str, Any] | None = None, /) -> object: ...

    def fetchall(self) -> Sequence[Sequence[Any]]: ...


class Statement(NamedTuple):
    """A statement of a store, with its parameters, to run later in an outcome's transaction.

    Made by a store method (``ResultStore.store_statement``,
    ``RateLimitStore.group_barrier_count_down``); run by :meth:`MessageStore.holds` or
    :meth:`MessageStore.run_many`, or alone by :meth:`MessageStore.run`.
    """

    query: str
    params: dict[str, Any]


# -- rows -------------------------------------------------------------------------------
class EnqueueStatement(NamedTuple):
    """Which enqueue statement stores a batch and its parameters (``_runtime.enqueue_statement``).

    ``name``: ``enqueue`` (a batch with idempotency keys), ``enqueue_unkeyed`` or
    ``enqueue_one`` (one message without a key).
    """

    name: str
    params: dict[str, Any]


class EnqueueRow(NamedTuple):
    """A row of an enqueue statement: each fills one part, the others are None.

    ``payload``/``notified``: a wake-up payload (``"<queue>"``, ``"<queue>@<due>"``, with a
    ``!`` for a prioritized message) and ``pg_notify``'s result (None when not sent);
    ``key``: an idempotency key actually inserted; ``id``/``message_id``: an inserted row
    (with ``return_ids``).
    """

    payload: str | None
    notified: object
    key: str | None
    id: int | None
    message_id: str | None


class ClaimRow(NamedTuple):
    """A message claimed by :meth:`MessageStore.claim`, with the claim's clock columns."""

    #: Row id in ``messages``.
    id: int
    #: Claims of the row so far, this one included.
    attempts: int
    #: The encoded message.
    payload: bytes
    #: Until the consumer's next due time, ms from the statement's ``now()`` (None: none upcoming).
    next_due_in_ms: float | None
    #: The statement's ``now()``, epoch milliseconds (database clock).
    db_now_ms: float
    #: Its ``broker_priority`` (0: none).
    priority: int
    #: Whether the queue has prioritized rows pending.
    prioritized: bool
    #: Its due time (``next_attempt_at``), the watermark's key with ``id``.
    due_at: dt.datetime
    #: Whether the queue has messages with a concurrency key pending.
    keyed: bool
    #: Whether this message has a concurrency key (it moves no watermark).
    row_keyed: bool | None


class QueueClaimRow(NamedTuple):
    """A row of :meth:`MessageStore.claim_queues`: a :class:`ClaimRow` of the queue ``queue_name``."""

    queue_name: str
    id: int | None
    attempts: int
    payload: bytes
    next_due_in_ms: float | None
    db_now_ms: float
    priority: int
    prioritized: bool
    due_at: dt.datetime
    keyed: bool
    row_keyed: bool | None


class QueueClaim(NamedTuple):
    """One queue's part of :meth:`MessageStore.claim_queues`: what to claim, from where."""

    queue_name: str
    #: Most rows to claim for it.
    limit: int
    #: Its consumer's watermark (both None: a sweep).
    from_at: dt.datetime | None
    from_id: int | None
    #: Its consumer's (consumers, rank) (see ``consumer_rank``).
    consumers: int
    rank: int


class Claim(NamedTuple):
    """What one claim returned: the rows claimed and when to claim next."""

    #: The claimed rows, in the statement's order (may be empty).
    rows: list[ClaimRow]
    #: Until the earliest upcoming due time of this consumer, in ms from the statement's
    #: ``now()``; None: nothing of its own is upcoming.
    next_due_in_ms: float | None
    #: The statement's ``now()``, epoch milliseconds.
    db_now_ms: float
    #: Whether the queue has prioritized rows pending (then claim with ``prioritized=True``).
    prioritized: bool
    #: Whether the queue has messages with a concurrency key pending (then claim with ``keyed=True``).
    keyed: bool = False
    #: The last concurrency key of a keyed claim's walk, where the next one starts (None: from
    #: the first key, once the walk reached the last one).
    next_key: str | None = None


class ConsumerRank(NamedTuple):
    """Live worker processes consuming a queue, and how many have a smaller id than this one."""

    consumers: int
    rank: int
    #: Whether this process's heartbeat names the queue yet.
    listed: bool


class Fence(NamedTuple):
    """A row archived by a fenced statement: its id and the lease of the delivery that decided."""

    id: int
    lease: uuid.UUID


class Requeued(NamedTuple):
    """Rows handed back to one queue by :meth:`MessageStore.requeue`."""

    queue_name: str
    n: int
    notified: object


class CommitNotification(NamedTuple):
    """A wake-up waiting for its transaction (``notify_committed``): ``status`` from ``pg_xact_status``."""

    xid: str
    payload: str
    #: ``committed`` (sent now), ``aborted`` (dropped), ``in progress`` (keep for the next flush).
    status: str | None


class RescueCounts(NamedTuple):
    """What one rescue pass did."""

    released: int
    quarantined: int
    dead_workers: int
    woken: int
    #: Rows an operator asked to cancel, archived as canceled instead of released.
    canceled: int


class ReclaimRow(NamedTuple):
    """What one call of ``reclaim_messages`` did."""

    slot: int
    rotated: bool
    moved: int
    truncated: int
    busy: int


class SchemaRevision(NamedTuple):
    """``schema_revision``: whether the messages table exists, and its comment (which names the revision).

    Another driver's row of that statement (SQLAlchemy's, Django's) converts with ``SchemaRevision(*row)``.
    """

    exists: bool
    comment: str | None


_CLAIM_ROWS = named_rows(ClaimRow)
_QUEUE_CLAIM_ROWS = named_rows(QueueClaimRow)
_FENCES = named_rows(Fence)


def listen(conn: psycopg.Connection[Any], *, channel: str) -> None:
    """``LISTEN`` to ``channel`` on ``conn`` (the name quoted as an identifier)."""
    conn.execute(with_identifiers(raw_queries()["listen"], channel=channel))


def unlisten(conn: psycopg.Connection[Any], *, channel: str) -> None:
    """``UNLISTEN`` ``channel`` on ``conn`` (the name quoted as an identifier)."""
    conn.execute(with_identifiers(raw_queries()["unlisten"], channel=channel))


def notify_channel(conn: psycopg.Connection[Any], *, channel: str, payloads: Sequence[str]) -> None:
    """Send each of ``payloads`` on ``channel`` (the ``notify`` statement, no schema needed)."""
    conn.execute(raw_queries()["notify"], {"channel": channel, "queue_names": list(payloads)})


#: The parameters of ``enqueue_one`` and their types, as its casts give them (the channel,
#: an argument of ``pg_notify``, is text).
ENQUEUE_ONE_TYPES = {
    "queue_name": TEXT,
    "actor_name": TEXT,
    "message_id": TEXT,
    "delay": BIGINT,
    "payload": BYTEA,
    "priority": SMALLINT,
    "channel": TEXT,
    "notify": BOOLEAN,
    "notify_within": BIGINT,
    "return_ids": BOOLEAN,
    "park_after_ms": BIGINT,
}


class MessageStore(SchemaStore):
    """The ``queries.sql`` statements of the runtime, the broker and the outboxes (:class:`SchemaStore`)."""

    def __init__(self, schema: str) -> None:
        super().__init__(schema)
        queries = self.queries
        # The hot path's statements, looked up once.
        self._claim = queries["claim"]
        self._claim_prioritized = queries["claim_prioritized"]
        self._claim_queues = queries["claim_queues"]
        self._claim_keys = queries["claim_keys"]
        self._claim_keyed = queries["claim_keyed"]
        #: The advisory lock space of this schema's concurrency keys (claim_keys).
        self.lock_space = zlib.crc32(f"dramatiq_pg_outbox.concurrency.{schema}".encode()) & 0x7FFFFFFF
        self._ack = queries["ack"]
        self._archive = queries["archive"]
        self._requeue = queries["requeue"]
        self._enqueue_one = Numbered.of(
            queries["enqueue_one"],
            ENQUEUE_ONE_TYPES,
            f"dramatiq_pg_outbox_enqueue_one_{zlib.crc32(queries['enqueue_one'].encode()):08x}",
        )

    # -- statements run later (an outcome's) --------------------------------------------
    def holds(self, conn: psycopg.Connection[Any], statement: Statement) -> bool:
        """Run ``statement`` (one row of one boolean column); whether it returned true."""
        row = conn.execute(statement.query, statement.params).fetchone()
        return row is not None and row[0] is True

    def run(self, conn: psycopg.Connection[Any], statement: Statement) -> None:
        """Run ``statement``, its rows ignored."""
        conn.execute(statement.query, statement.params)

    def run_many(self, conn: psycopg.Connection[Any], statements: Sequence[Statement]) -> None:
        """Run ``statements``: one ``executemany`` per statement text (psycopg pipelines it)."""
        grouped: dict[str, list[dict[str, Any]]] = {}
        for query, params in statements:
            grouped.setdefault(query, []).append(params)
        for query, many in grouped.items():
            conn.cursor().executemany(query, many)

    # -- connections ----------------------------------------------------------------------
    def session_settings(self, conn: psycopg.Connection[Any]) -> None:
        """Make ``conn``'s prepared statements run one generic plan, and no JIT (``session_settings``)."""
        conn.execute(self.queries["session_settings"])

    def schema_revision(self, cursor: Cursor) -> SchemaRevision:
        """Whether the schema's ``messages`` table exists, and its comment (which holds the revision).

        Parameters:
          cursor(Cursor): Any DB-API cursor (an outbox checks the application's database).
        """
        cursor.execute(self.queries["schema_revision"], {"table": f"{quote_ident(self.schema)}.messages"})
        rows = cursor.fetchall()
        return SchemaRevision(*rows[0]) if rows else SchemaRevision(False, None)

    # -- enqueue ----------------------------------------------------------------------------
    def enqueue(self, cursor: Cursor, statement: EnqueueStatement) -> list[EnqueueRow]:
        """Store a batch of messages with one statement (see ``_runtime.enqueue_statement``).

        Parameters:
          cursor(Cursor): A psycopg cursor, or the application's (an outbox's transaction).
          statement(EnqueueStatement): The statement chosen for the batch and its parameters.

        Raises:
          ValueError: If ``statement.name`` is not an enqueue statement.
        """
        if statement.name not in ENQUEUE_STATEMENTS:
            raise ValueError(f"not an enqueue statement: {statement.name!r}")
        cursor.execute(self.queries[statement.name], statement.params)
        return [EnqueueRow._make(row) for row in cursor.fetchall()]

    def enqueue_send(self, cursor: Cursor, statement: EnqueueStatement) -> None:
        """Send the enqueue ``statement`` without reading its rows (:meth:`enqueue_rows` reads them).

        For a cursor of a connection in psycopg's pipeline mode: the statement is
        queued, and sent with what follows it (an outbox's ``COMMIT``).

        Raises:
          ValueError: If ``statement.name`` is not an enqueue statement.
        """
        if statement.name not in ENQUEUE_STATEMENTS:
            raise ValueError(f"not an enqueue statement: {statement.name!r}")
        cursor.execute(self.queries[statement.name], statement.params)

    def commit_send(self, cursor: Cursor) -> None:
        """Send ``COMMIT`` on ``cursor`` (queued after :meth:`enqueue_send` in pipeline mode)."""
        cursor.execute(self.queries["commit"])

    def enqueue_one_and_commit(
        self, conn: psycopg.Connection[Any], statement: EnqueueStatement
    ) -> list[EnqueueRow]:
        """Run ``statement`` (an ``enqueue_one``) then ``COMMIT`` on ``conn``, in one round trip.

        The outbox's common case, written through libpq's pipeline (:mod:`.libpq`: the
        same messages as psycopg's pipeline mode, without its Python machinery). ``conn``
        must be in a transaction, outside psycopg's pipeline mode.

        Raises:
          ValueError: If ``statement.name`` is not ``enqueue_one``.
          psycopg.Error: The server's error (the INSERT's, which leaves the transaction
            aborted, or the COMMIT's), or ``OperationalError`` if the connection was lost.
        """
        if statement.name != "enqueue_one":
            raise ValueError(f"not enqueue_one: {statement.name!r}")
        rows = execute_and_commit(conn, self._enqueue_one, statement.params)
        return [
            EnqueueRow(
                None if payload is None else payload.decode(),
                notified,
                None if key is None else key.decode(),
                None if id_ is None else int(id_),
                None if message_id is None else message_id.decode(),
            )
            for payload, notified, key, id_, message_id in rows
        ]

    def enqueue_rows(self, cursor: Cursor) -> list[EnqueueRow]:
        """The rows of the enqueue statement sent on ``cursor`` by :meth:`enqueue_send`."""
        return [EnqueueRow._make(row) for row in cursor.fetchall()]

    def enqueue_query(self, statement: EnqueueStatement) -> Statement:
        """``statement`` as a :class:`Statement`, to be run alone later (:meth:`run`)."""
        if statement.name not in ENQUEUE_STATEMENTS:
            raise ValueError(f"not an enqueue statement: {statement.name!r}")
        return Statement(self.queries[statement.name], statement.params)

    def notify(self, conn: psycopg.Connection[Any], *, channel: str, queue_names: Sequence[str]) -> None:
        """Send each payload of ``queue_names`` (``"<queue>"`` or ``"<queue>@<due>"``) on ``channel``."""
        conn.execute(self.queries["notify"], {"channel": channel, "queue_names": list(queue_names)})

    def notify_committed(
        self, conn: psycopg.Connection[Any], *, channel: str, xids: Sequence[str], payloads: Sequence[str]
    ) -> list[CommitNotification]:
        """Send the payloads whose transaction committed; each pair with its transaction's status."""
        params = {"channel": channel, "xids": list(xids), "payloads": list(payloads)}
        return (
            conn.cursor(row_factory=named_rows(CommitNotification))
            .execute(self.queries["notify_committed"], params)
            .fetchall()
        )

    def current_xact_id(self, cursor: Cursor) -> str:
        """The id of the transaction of ``cursor`` (``pg_current_xact_id()``), as text."""
        cursor.execute(self.queries["current_xact_id"])
        ((xid,),) = cursor.fetchall()
        return str(xid)

    def surviving_ids(self, cursor: Cursor, *, ids: Sequence[int]) -> set[int]:
        """Which of ``ids``, rows written earlier in this transaction, still exist."""
        cursor.execute(self.queries["surviving_ids"], {"ids": list(ids)})
        return {int(row_id) for (row_id,) in cursor.fetchall()}

    # -- claims -----------------------------------------------------------------------------
    def claim(
        self,
        conn: psycopg.Connection[Any],
        *,
        prioritized: bool,
        queue_name: str,
        limit: int,
        lease: uuid.UUID,
        owner: uuid.UUID,
        consumers: int,
        rank: int,
        look_ahead: int,
        from_at: dt.datetime | None,
        from_id: int | None,
        keyed: bool = False,
        after_key: str | None = None,
        unkeyed: bool = True,
    ) -> Claim:
        """Claim up to ``limit`` due messages of ``queue_name`` under ``lease`` (``claim``).

        Parameters:
          prioritized(bool): Claim the prioritized rows first (``claim_prioritized``).
          keyed(bool): The queue has messages with a concurrency key: claim within their
            limits (``claim_keys`` then ``claim_keyed``, one transaction; with ``prioritized``,
            the prioritized rows of each key and of the rest first).
          after_key(str|None): Where the keyed claim's walk over the keys starts
            (``Claim.next_key`` of the previous one).
          unkeyed(bool): Whether the keyed claim also looks for messages without a key
            (see ``claim_keyed``); the plain claims always do.
          owner(uuid.UUID): This process's worker id.
          consumers(int), rank(int): Of the consumer (see ``consumer_rank``): which due
            times the returned ``next_due_in_ms`` is about.
          look_ahead(int): Upcoming delayed rows read at most to find it.
          from_at(datetime|None), from_id(int|None): The watermark (both None: a sweep).
        """
        params = {
            "queue_name": queue_name,
            "limit": _bigint(limit),
            "lease": lease,
            "owner": owner,
            "consumers": _bigint(consumers),
            "rank": _bigint(rank),
            "look_ahead": _bigint(look_ahead),
            "from_at": from_at,
            "from_id": None if from_id is None else _bigint(from_id),
        }
        if keyed:
            return self._keyed_claim(
                conn, {**params, "prioritized": prioritized, "unkeyed": unkeyed}, after_key=after_key
            )
        query = self._claim_prioritized if prioritized else self._claim
        rows = conn.cursor(row_factory=_CLAIM_ROWS).execute(query, params).fetchall()
        return self._claim_of(rows)

    def claim_queues(
        self,
        conn: psycopg.Connection[Any],
        queues: Sequence[QueueClaim],
        *,
        lease: uuid.UUID,
        owner: uuid.UUID,
        look_ahead: int,
    ) -> dict[str, Claim]:
        """The plain claim of several queues in one statement (``claim_queues``), one lease for all.

        Parameters:
          queues(Sequence[QueueClaim]): One per queue, distinct queue names.
          lease(uuid.UUID): The lease of every row claimed.
          owner(uuid.UUID): This process's worker id.
          look_ahead(int): Upcoming delayed rows read at most per queue for its next due time.

        Returns:
          dict[str, Claim]: Each queue's claim, by queue name (``next_key`` None).
        """
        params = {
            "queue_names": [q.queue_name for q in queues],
            "limits": [_bigint(q.limit) for q in queues],
            "from_ats": [q.from_at for q in queues],
            "from_ids": [None if q.from_id is None else _bigint(q.from_id) for q in queues],
            "consumers": [_bigint(q.consumers) for q in queues],
            "ranks": [_bigint(q.rank) for q in queues],
            "lease": lease,
            "owner": owner,
            "look_ahead": _bigint(look_ahead),
        }
        rows = conn.cursor(row_factory=_QUEUE_CLAIM_ROWS).execute(self._claim_queues, params).fetchall()
        by_queue: dict[str, list[ClaimRow]] = {}
        for row in rows:
            by_queue.setdefault(row.queue_name, []).append(ClaimRow._make(row[1:]))
        return {name: self._claim_of(found) for name, found in by_queue.items()}

    def warm_claims(self, conn: psycopg.Connection[Any], *, owner: uuid.UUID) -> None:
        """Run the plain claims once each way their parameters are typed, claiming nothing.

        ``claim`` and ``claim_queues`` with a limit of 0 (no row is locked or changed), as a
        sweep (no watermark: NULL bounds) and bounded: psycopg keys a prepared statement by
        its parameters' types, so each is a statement of its own.  On a connection that
        prepares at the first run with generic plans (the runtime's pool), this plans them
        before a message waits on it: planning a claim over the partitions of ``messages``
        takes milliseconds, the slowest wake-ups of an idle worker
        (benchmarks/README.md, section 28).

        Parameters:
          owner(uuid.UUID): This process's worker id (typed as the real claims' owner).

        Raises:
          psycopg.Error: If the schema lacks what the claims read (not migrated yet).
        """
        lease = uuid.uuid4()
        for from_at, from_id in ((None, None), (dt.datetime.now(dt.timezone.utc), 0)):
            self.claim(conn, prioritized=False, queue_name="", limit=0, lease=lease, owner=owner,
                       consumers=1, rank=0, look_ahead=LOOK_AHEAD,
                       from_at=from_at, from_id=from_id)  # fmt: skip
            queue = QueueClaim("", 0, from_at, from_id, 1, 0)
            self.claim_queues(conn, [queue], lease=lease, owner=owner, look_ahead=LOOK_AHEAD)

    @staticmethod
    def _claim_of(rows: list[ClaimRow], next_key: str | None = None) -> Claim:
        # Every row carries the clock columns; a claim of nothing is one row with a NULL id.
        clock = rows[0]
        if clock.id is None:
            rows = []
        return Claim(rows, clock.next_due_in_ms, clock.db_now_ms, bool(clock.prioritized), bool(clock.keyed),
                     next_key)  # fmt: skip

    def _keyed_claim(
        self, conn: psycopg.Connection[Any], params: dict[str, Any], *, after_key: str | None
    ) -> Claim:
        """claim_keys then claim_keyed, in one READ COMMITTED transaction (see queries.sql)."""
        limit = int(params["limit"])
        # Walk at most this many keys per claim (keys at their limit give nothing).
        keys_wanted = max(limit, 8)
        with conn.transaction():
            found = conn.execute(
                self._claim_keys,
                {"queue_name": params["queue_name"], "after_key": after_key, "keys": keys_wanted,
                 "walk": 4 * keys_wanted, "lock_space": self.lock_space},
            ).fetchall()  # fmt: skip
            keys = [str(key) for key, _ in found]
            per_key = max(1, limit // max(1, len(keys)))
            rows = (
                conn.cursor(row_factory=_CLAIM_ROWS)
                .execute(
                    self._claim_keyed,
                    {**params, "keys": keys, "limits": [lim for _, lim in found], "per_key": per_key},
                )
                .fetchall()
            )
        # A walk that found fewer keys than it wanted reached the last key: the next starts over.
        return self._claim_of(rows, keys[-1] if len(keys) >= keys_wanted else None)

    def consumer_rank(
        self,
        conn: psycopg.Connection[Any],
        *,
        queue_names: Sequence[str],
        worker_id: uuid.UUID,
        heartbeat_timeout_ms: int,
    ) -> dict[str, ConsumerRank]:
        """How many live processes consume each of ``queue_names`` and this one's rank among them.

        Returns:
          dict[str, ConsumerRank]: By queue name, one per name.
        """
        params = {
            "queue_names": list(queue_names),
            "worker_id": worker_id,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
        }
        rows = conn.execute(self.queries["consumer_rank"], params).fetchall()
        return {str(name): ConsumerRank(int(n), int(rank), bool(listed)) for name, n, rank, listed in rows}

    # -- decisions ----------------------------------------------------------------------------
    def ack(self, conn: psycopg.Connection[Any], *, ids: Sequence[int], fences: Sequence[str]) -> int:
        """Archive completed messages whose lease still holds (``ack``); how many were archived.

        Parameters:
          ids(list[int]), fences(list[str]): See ``_runtime.fence_params``.
        """
        return conn.execute(self._ack, self._fence(ids, fences)).rowcount

    @staticmethod
    def _fence(ids: Sequence[int], fences: Sequence[str]) -> dict[str, Any]:
        """The ``ids`` and ``fences`` parameters of a fenced statement, as array literals."""
        return {"ids": _array_literal(ids), "fences": _array_literal(fences)}

    def ack_fenced(
        self, conn: psycopg.Connection[Any], *, ids: Sequence[int], fences: Sequence[str]
    ) -> list[Fence]:
        """:meth:`ack`, returning the (id, lease) of each row archived."""
        cur = conn.cursor(row_factory=_FENCES)
        return cur.execute(self._ack, self._fence(ids, fences)).fetchall()

    def archive(
        self,
        conn: psycopg.Connection[Any],
        *,
        ids: Sequence[int],
        fences: Sequence[str],
        state: str,
        error_types: Sequence[str | None],
        errors: Sequence[str | None],
    ) -> int:
        """Move messages to history in ``state`` with their errors (``archive``); how many moved.

        Parameters:
          state(str): ``failed`` (a dead letter) or ``completed`` (acked after an error).
          error_types(list[str]), errors(list[str]): One per fence, in the same order.
        """
        params = {**self._fence(ids, fences), "state": state, "error_types": error_types, "errors": errors}
        return conn.execute(self._archive, params).rowcount

    def archive_fenced(
        self,
        conn: psycopg.Connection[Any],
        *,
        ids: Sequence[int],
        fences: Sequence[str],
        state: str,
        error_types: Sequence[str | None],
        errors: Sequence[str | None],
    ) -> list[Fence]:
        """:meth:`archive`, returning the (id, lease) of each row archived."""
        params = {**self._fence(ids, fences), "state": state, "error_types": error_types, "errors": errors}
        return conn.cursor(row_factory=_FENCES).execute(self._archive, params).fetchall()

    def requeue(
        self,
        conn: psycopg.Connection[Any],
        *,
        ids: Sequence[int],
        fences: Sequence[str],
        notify: bool,
        channel: str,
    ) -> list[Requeued]:
        """Hand claimed, unstarted messages back without charging the attempt (``requeue``).

        Returns:
          list[Requeued]: The rows released per queue (their consumers were woken if ``notify``).
        """
        params = {**self._fence(ids, fences), "notify": notify, "channel": channel}
        return conn.cursor(row_factory=named_rows(Requeued)).execute(self._requeue, params).fetchall()

    # -- maintenance ----------------------------------------------------------------------------
    def heartbeat(
        self,
        conn: psycopg.Connection[Any],
        *,
        id: uuid.UUID,
        hostname: str,
        pid: int,
        queues: Sequence[str],
        running: Sequence[int],
        actors: Sequence[str] = (),
    ) -> None:
        """Insert or refresh the ``workers`` row of process ``id`` (its queues, running row ids
        and the names of the actors its broker declares)."""
        params = {
            "id": id,
            "hostname": hostname,
            "pid": pid,
            "queues": list(queues),
            "running": list(running),
            "actors": list(actors),
        }
        conn.execute(self.queries["heartbeat"], params)

    def unregister_worker(self, conn: psycopg.Connection[Any], *, id: uuid.UUID) -> None:
        """Delete the ``workers`` row of process ``id``."""
        conn.execute(self.queries["unregister_worker"], {"id": id})

    def rescue(
        self,
        conn: psycopg.Connection[Any],
        *,
        worker_id: uuid.UUID,
        heartbeat_timeout_ms: int,
        max_lease_ms: int | None,
        max_deliveries: int,
        channel: str,
    ) -> RescueCounts:
        """Release (or quarantine) the claims of dead workers and those older than ``max_lease_ms``.

        Parameters:
          worker_id(uuid.UUID): The rescuing process: never judged dead, whatever its heartbeat
            (see the statement).
        """
        params = {
            "worker_id": worker_id,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "max_lease_ms": max_lease_ms,
            "max_deliveries": max_deliveries,
            "channel": channel,
        }
        row = conn.execute(self.queries["rescue"], params).fetchone()
        assert row is not None
        return RescueCounts(*(int(n) for n in row))

    def release_orphans(
        self, conn: psycopg.Connection[Any], *, owner: uuid.UUID, grace_ms: int, known_ids: Sequence[int]
    ) -> tuple[int, int]:
        """Release the claims of ``owner`` older than ``grace_ms`` ms and not in ``known_ids``.

        Returns:
          tuple[int, int]: Rows released, and rows archived as canceled instead (an
          operator asked to cancel them, see the statement).
        """
        params = {"owner": owner, "grace_ms": grace_ms, "known_ids": list(known_ids)}
        row = conn.execute(self.queries["release_orphans"], params).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def cancel_requests(
        self, conn: psycopg.Connection[Any], *, owner: uuid.UUID, ids: Sequence[int]
    ) -> list[int]:
        """Which of the claims ``ids`` of process ``owner`` an operator asked to cancel (row ids)."""
        rows = conn.execute(self.queries["cancel_requests"], {"owner": owner, "ids": list(ids)}).fetchall()
        return [int(row[0]) for row in rows]

    def create_history_partitions(self, conn: psycopg.Connection[Any], *, days: int) -> int:
        """Create the history partitions of the next ``days`` days; how many were created."""
        return self._count(conn, self.queries["create_history_partitions"], {"days": days})

    def reclaim_messages(
        self,
        conn: psycopg.Connection[Any],
        *,
        rotate_ms: int,
        park_after_ms: int,
        max_slots: int,
        channel: str,
        max_moved: int,
    ) -> ReclaimRow | None:
        """One call of ``reclaim_messages()``; None when another process held the ring."""
        params = {
            "rotate_ms": rotate_ms,
            "park_after_ms": park_after_ms,
            "max_slots": max_slots,
            "channel": channel,
            "max_moved": max_moved,
        }
        cur = conn.cursor(row_factory=named_rows(ReclaimRow))
        return cur.execute(self.queries["reclaim_messages"], params).fetchone()

    # -- queues ------------------------------------------------------------------------------------
    def queue_size(self, conn: psycopg.Connection[Any], *, queue_names: Sequence[str]) -> int:
        """Stored messages of ``queue_names``, in one snapshot."""
        return self._count(conn, self.queries["queue_size"], {"queue_names": list(queue_names)})

    def purge(
        self, conn: psycopg.Connection[Any], *, queue_names: Sequence[str], ids: Sequence[int] | None
    ) -> list[int]:
        """Delete the messages of ``queue_names`` (only ``ids``, if given).

        Returns:
          list[int]: Ids of rows it saw but did not delete (moved meanwhile): purge them again.
        """
        row = conn.execute(self.queries["purge"], {"queue_names": list(queue_names), "ids": ids}).fetchone()
        assert row is not None
        return list(row[0] or [])

    @staticmethod
    def _count(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> int:
        """The one integer that ``query`` returns."""
        row = conn.execute(query, params).fetchone()
        assert row is not None
        return int(row[0])


@functools.lru_cache(maxsize=16)
def message_store(schema: str) -> MessageStore:
    """The :class:`MessageStore` of ``schema``, made once (for the outboxes, which hold no runtime).

    Raises:
      ValueError: If ``schema`` is not a valid schema name.
    """
    return MessageStore(schema)
