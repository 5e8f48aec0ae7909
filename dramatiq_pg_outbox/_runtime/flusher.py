"""The flush loop: ack/nack/requeue decisions buffered by worker threads, written in batches.

Worker threads append to lock-free deques; a window after the first decision
(``flush_interval`` ms when the process idles, up to ``max_flush_delay`` while a
backlog drains: :func:`next_window`), or at once when ``flush_batch_size``
decisions are unwritten, each kind is written with one set-based statement,
fenced by the lease.  A worker thread that decides while ``2 x flush_batch_size``
are unwritten waits for the flusher, which bounds what runs again after a crash.
A failed write keeps its batch and is retried with backoff; the final flush runs
on stop.  River's batch completer is the model.  An outcome whose follow-ups the
database refuses for good is quarantined alone (see :data:`UNWRITABLE`).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg

from ..options import UNWRITTEN_BATCHES
from ..store.messages import Fence, Statement
from .host import Runtime
from .messages import (
    Conditional,
    Outcome,
    StoredMessage,
    clip_error,
    enqueue_result,
    enqueue_statement,
    fence_params,
)
from .notifier import Notifier
from .service import Service

#: Errors that writing the same values again can never fix: SQLSTATE class 22 (data
#: exception: a value out of range, such as a retry delay beyond PostgreSQL's interval)
#: and class 23 (integrity constraint violation), and psycopg's own refusals of a value
#: (a NUL character in a text).  When a batch of outcomes fails with one of these, its
#: outcomes are written one at a time, and one that fails alone is quarantined (see
#: ``Flusher._quarantine``).  Any other error (a lost connection, a missing grant, a
#: schema not migrated yet) keeps the batch for a retry, as it may pass.
UNWRITABLE = (psycopg.DataError, psycopg.IntegrityError)

#: Longest wait for the reply of a NOTIFY written by :meth:`Flusher.notify_later`, in seconds: the
#: connection is then closed and the payloads sent again on a pooled one.
NOTIFY_REPLY_TIMEOUT = 5.0

#: The ``error_type`` in history of a message quarantined because its follow-ups can never be written.
FOLLOW_UP_NOT_WRITABLE = "FollowUpNotWritable"

#: A flush that wrote at least this many decisions doubles the window (a backlog drains: at
#: the 5 ms default, 3,200 decisions per second in the process or more).
GROW_AT = 16
#: A flush that wrote fewer halves it (few decisions per statement: a longer window would
#: delay follow-ups for little saving).
SHRINK_BELOW = 4


def next_window(window: float, shortest: float, longest: float, *, decisions: int, full: bool) -> float:
    """The window after a pass that wrote ``decisions`` after waiting ``window``: doubled, kept or halved.

    A pass ended by a full batch (``full``: ``flush_batch_size`` decisions unwritten)
    keeps the window: the count bound, not the window, set its size.  Otherwise
    :data:`GROW_AT` decisions or more double it and fewer than :data:`SHRINK_BELOW`
    halve it; in between it is kept.  The flusher also resets it to ``shortest`` when
    the process idled for a whole window (see ``Flusher.pause``), so a lone message's
    follow-up is written after ``shortest``.  The same multiplicative increase and
    decrease as the consumers' claims (``broker.consumer.claim_limit``) and TCP's
    congestion window (RFC 5681), on a batch of writes; pgqueuer's completion buffer
    (a batch or 100 ms) is the fixed-window model.

    Parameters:
      window(float), shortest(float), longest(float): Seconds, ``shortest <= longest``.
      decisions(int): Decisions (acks, nacks, cancels, with or without follow-ups) the pass wrote.
      full(bool): Whether the pass was started by the count bound rather than the window's end.

    Returns:
      float: The next window, in seconds, within [shortest, longest].
    """
    if full:
        return min(longest, max(shortest, window))
    if decisions >= GROW_AT:
        return min(longest, max(shortest, 2 * window))
    if decisions < SHRINK_BELOW:
        return max(shortest, min(longest, window / 2))
    return min(longest, max(shortest, window))


class FlushPass(NamedTuple):
    """One pass of the flush loop, as recorded in ``Flusher.passes`` (for tests and debugging).

    Attributes:
      window_ms(float): The window the pass waited for, after the oldest decision it wrote.
      waited_ms(float): How long the oldest decision had waited when the pass began writing.
      decisions(int): Decisions the pass wrote (stale ones included).
      full(bool): Whether the count bound, not the window, started it.
    """

    window_ms: float
    waited_ms: float
    decisions: int
    full: bool


class Flusher(Service):
    """The flush loop of a process (a :class:`~.service.Service`, started by the first decision).

    Parameters:
      runtime(Runtime): The process's runtime; reads ``flush_interval``,
        ``max_flush_delay`` (ms) and ``flush_batch_size`` of its broker.  A failed
        flush is retried after 50 ms, doubling up to 5 s.
    """

    name = "flush"
    pause_first = True

    def __init__(self, runtime: Runtime) -> None:
        options = runtime.broker.options
        super().__init__(options.flush_interval / 1000, backoff_first=0.05, backoff_max=5.0)
        self.runtime = runtime
        #: The window of the next pass, seconds: between ``flush_interval`` and ``max_flush_delay``.
        self.window = self.interval
        self._longest = (options.max_flush_delay or options.flush_interval) / 1000
        self._batch = options.flush_batch_size
        #: Most decided but unwritten messages before a deciding worker thread waits.
        self.bound = UNWRITTEN_BATCHES * options.flush_batch_size
        #: Recent passes that wrote decisions (the last 256).
        self.passes: deque[FlushPass] = deque(maxlen=256)
        #: Most decided but unwritten messages seen (a worker thread's own decision included).
        self.most_unwritten = 0
        # Tickets of decisions (next() of a count is atomic in CPython) and how many were written:
        # their difference is what a crash now would leave to run again.
        self._tickets = itertools.count(1)
        self._written = 0
        self._last_ticket = 0
        self._room = threading.Condition(threading.Lock())
        # When the oldest unwritten decision was made (monotonic seconds), None when there is none.
        self._oldest: float | None = None
        self._full = False
        self.acks: deque[tuple[int, uuid.UUID]] = deque()
        self.nacks: deque[tuple[int, uuid.UUID, str, str]] = deque()
        self.failed_acks: deque[tuple[int, uuid.UUID, str, str]] = deque()
        #: Deliveries an operator canceled while they ran (archived as canceled).
        self.cancels: deque[tuple[int, uuid.UUID, str, str]] = deque()
        self.requeues: deque[tuple[int, uuid.UUID]] = deque()
        #: Decisions with follow-ups, each written with them in one transaction.
        self.outcomes: deque[Outcome] = deque()
        self.notifications: deque[str] = deque()
        #: (transaction id, payload): sent once that transaction committed.
        self.commit_notifications: deque[tuple[str, str]] = deque()
        self.stats = {"acked": 0, "nacked": 0, "canceled": 0, "requeued": 0, "stale": 0}
        self._urgent = threading.Event()
        self._flush_lock = threading.Lock()
        #: How many outcomes at the head of ``outcomes`` are written one at a time: those of a
        #: batch that failed with an :data:`UNWRITABLE` error, to find the one to quarantine.
        self._suspects = 0
        #: Whether the thread opens a pooled connection before its first wait (see :meth:`start_ahead`).
        self._warm = False
        #: Set once :meth:`warm_up` has run (a test signal).
        self.warmed = threading.Event()
        #: The wake-ups' own connection, opened by :meth:`warm_up` after :meth:`start_ahead`
        #: (an after-commit broker's outbox): ``notify_later`` writes on it at once.
        self.notifier: Notifier | None = None

    # Called from worker threads: lock-free appends, then a cheap signal.
    def ack(self, row_id: int, lease: uuid.UUID) -> None:
        self.acks.append((row_id, lease))
        self._decided()

    def nack(self, row_id: int, lease: uuid.UUID, error_type: str, error: str) -> None:
        self.nacks.append((row_id, lease, error_type, error))
        self._decided()

    def ack_with_error(self, row_id: int, lease: uuid.UUID, error_type: str, error: str) -> None:
        self.failed_acks.append((row_id, lease, error_type, error))
        self._decided()

    def cancel(self, row_id: int, lease: uuid.UUID, error_type: str, error: str) -> None:
        self.cancels.append((row_id, lease, error_type, error))
        self._decided()

    def finish(
        self,
        row_id: int,
        lease: uuid.UUID,
        kind: str,
        error_type: str | None = None,
        error: str | None = None,
        messages: list[StoredMessage] | None = None,
        statements: list[Statement] | None = None,
        conditional: list[Conditional] | None = None,
        refused: list[str] | None = None,
    ) -> None:
        """Buffer the end of a delivery (``kind``: ``ack``, ``ack_with_error``, ``nack``, ``cancel``).

        With follow-ups (``messages``, ``statements``, ``conditional``) it is written
        with them in one transaction (see :class:`Outcome`); without, with the other
        decisions of its kind in one statement.  With ``refused`` follow-ups (why each
        was refused when sent) the message is quarantined, none of its follow-ups written.
        """
        if messages or statements or conditional or refused:
            self.outcomes.append(
                Outcome(
                    row_id,
                    lease,
                    kind,
                    error_type,
                    error,
                    messages or [],
                    statements or [],
                    conditional or [],
                    refused or [],
                )
            )
            self._decided()
        elif kind == "ack":
            self.ack(row_id, lease)
        else:
            assert error_type is not None and error is not None
            if kind == "ack_with_error":
                self.ack_with_error(row_id, lease, error_type, error)
            elif kind == "cancel":
                self.cancel(row_id, lease, error_type, error)
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
        """Send these NOTIFY payloads soon, from the broker's own connection.

        Written at once, without waiting for the reply, on the :attr:`notifier`'s connection
        when the process has one and no statement is in flight on it (the flush thread
        reads the reply); otherwise buffered for the flush thread, which sends them on a
        pooled connection.
        """
        notifier = self.notifier
        if notifier is None or not notifier.send(payloads):
            self.notifications.extend(payloads)
        self._urgent.set()
        self._signal(1)

    def notify_after_commit(self, xid: str, payloads: Sequence[str]) -> None:
        """Send these NOTIFY payloads once transaction ``xid`` has committed (never if it aborts)."""
        self.commit_notifications.extend((xid, p) for p in payloads)
        self._urgent.set()
        self._signal(1)

    def start_ahead(self) -> None:
        """Start the flush thread before a commit hands it a NOTIFY (``notify="after_commit"``).

        Called at each message a binding buffers for an after-commit broker: the first call
        starts the thread, which waits for the pool's first connection and checks the
        schema on it while the application's transaction is still open, so the first
        commit's wake-up waits for neither (nor for a thread start).  Later calls cost one
        attribute read.
        """
        if self._thread is None:
            self._warm = True
            self.start()

    def warm_up(self) -> None:
        """After :meth:`start_ahead`: the pool's first connection taken, with the schema check.

        A failure (the database unreachable, the schema not migrated) is left to the first
        flush, which reports it.
        """
        if not self._warm:
            return
        try:
            with self.runtime.connection():
                pass
            self._open_notifier()
        except Exception as e:
            self.logger.debug("The flush thread could not warm a connection ahead: %s", e)
        self.warmed.set()

    def _open_notifier(self) -> None:
        """Open the :attr:`notifier`'s connection (after :meth:`start_ahead`), unless it is open."""
        if self.notifier is None:
            runtime = self.runtime
            self.notifier = Notifier(runtime.broker.conninfo, runtime.channel, runtime.connect_kwargs)
        self.notifier.open()

    def _signal(self, size: int) -> None:
        if not self.started:
            self.start()
        if size >= self._batch:
            self._urgent.set()
        self.wake()

    @property
    def unwritten(self) -> int:
        """Decided messages not written yet (buffered or in the statement being written)."""
        return max(0, self._last_ticket - self._written)

    def _ended(self) -> bool:
        """Whether the flush thread has run and ended (not: is about to start)."""
        thread = self._thread
        return thread is not None and thread.ident is not None and not thread.is_alive()

    def _wrote(self, decisions: int) -> None:
        """Count ``decisions`` written (or found stale), and let waiting worker threads go on."""
        with self._room:
            self._written += decisions
            self._room.notify_all()

    def _decided(self) -> None:
        """Count a decision just buffered; end the window at ``flush_batch_size`` unwritten; wait
        (on a worker thread, before its next message) while more than ``bound`` are unwritten.

        The wait ends when the flusher has written enough, or stops, or when Dramatiq stops
        the worker thread (its ``running`` flag), so a shutdown while the database is
        unreachable is not held up: the final flush logs what it could not write.
        """
        ticket = self._last_ticket = next(self._tickets)
        if self._oldest is None:
            self._oldest = time.monotonic()
        unwritten = ticket - self._written
        if unwritten > self.most_unwritten:
            self.most_unwritten = unwritten
        if unwritten >= self._batch:
            self._full = True
        self._signal(unwritten)
        if unwritten <= self.bound:
            return
        thread = threading.current_thread()
        with self._room:
            while (
                ticket - self._written > self.bound
                and not self.stopping
                and not self._ended()
                and getattr(thread, "running", True)
                and thread is not self._thread
            ):
                self._room.wait(0.1)

    def pending(self) -> int:
        buffers = (
            self.acks,
            self.nacks,
            self.failed_acks,
            self.cancels,
            self.requeues,
            self.outcomes,
            self.notifications,
        )
        return sum(len(b) for b in buffers)

    # -- the service -----------------------------------------------------------------
    def pause(self, delay: float) -> None:
        """Until a decision arrives (after a failure: ``delay``), then until the window after
        the oldest unwritten decision has passed.

        Decisions arriving in that window are written together; an urgent one (a full
        batch, a requeue, a notification) ends the window at once.  A wait for the first
        decision longer than the window (the process idled) resets the window to
        ``flush_interval``.
        """
        if self.failures:
            self._wake.set()  # the kept batch is written as soon as the backoff ends
            self._stopping.wait(delay)
        if not self._wake.is_set():
            idle_since = time.monotonic()
            self._wake.wait()
            if time.monotonic() - idle_since > self.window:
                self.window = self.interval
        oldest = self._oldest
        now = time.monotonic()
        if oldest is None or oldest > now:
            oldest = now
        left = oldest + self.window - now
        if left > 0:
            self._urgent.wait(left)
        self._wake.clear()
        self._urgent.clear()

    def next_delay(self) -> float:
        return 0.0

    def log_failure(self, error: Exception, delay: float) -> None:
        self.logger.warning(
            "Flush failed (attempt %d), %d decisions kept for retry in %dms: %s",
            self.failures,
            self.pending(),
            delay * 1000,
            error,
        )

    def run_once(self) -> dict[str, int]:
        """One pass of the loop: :meth:`flush_once`, then the next window from what it wrote."""
        window, full = self.window, self._full
        done = self.flush_once()
        decisions = done["acked"] + done["nacked"] + done["canceled"] + done["stale"]
        if decisions:
            self.window = next_window(window, self.interval, self._longest, decisions=decisions, full=full)
        return done

    def flush_once(self) -> dict[str, int]:
        """Write everything buffered; on failure the undone part is put back and the error re-raised.

        Returns:
          dict[str, int]: How many acks, nacks, cancels, requeues were written and how many were stale.
        """
        with self._flush_lock:
            oldest, full = self._oldest, self._full
            self._oldest, self._full = None, False
            started = time.monotonic()
            try:
                done = self._flush_locked()
            except Exception:
                if oldest is not None:
                    later = self._oldest
                    self._oldest = oldest if later is None else min(oldest, later)
                self._full = self._full or full
                raise
            decisions = done["acked"] + done["nacked"] + done["canceled"] + done["stale"]
            if decisions:
                waited = 0.0 if oldest is None else max(0.0, started - oldest)
                self.passes.append(FlushPass(self.window * 1000, waited * 1000, decisions, full))
            return done

    def _flush_locked(self) -> dict[str, int]:
        done = {"acked": 0, "nacked": 0, "canceled": 0, "requeued": 0, "stale": 0}
        batch = self.runtime.broker.options.flush_batch_size
        kinds: tuple[tuple[str, deque[Any]], ...] = (
            ("requeue", self.requeues),
            ("ack", self.acks),
            ("ack_with_error", self.failed_acks),
            ("nack", self.nacks),
            ("cancel", self.cancels),
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
                if name != "requeue":
                    self._wrote(len(items))
                stale = len(items) - written
                key = {
                    "ack": "acked",
                    "ack_with_error": "acked",
                    "nack": "nacked",
                    "cancel": "canceled",
                    "requeue": "requeued",
                }[name]
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
            # One with refused follow-ups is quarantined alone; a batch stops before it.
            size = 1 if self._suspects or self.outcomes[0].refused else batch
            outcomes = [self.outcomes.popleft()]
            while self.outcomes and len(outcomes) < size and not self.outcomes[0].refused:
                outcomes.append(self.outcomes.popleft())
            quarantined = dropped = 0
            try:
                if outcomes[0].refused:
                    finished = []
                    quarantined = self._quarantine(outcomes[0], None)
                else:
                    finished = self._write_outcomes(outcomes)
            except UNWRITABLE as e:
                if len(outcomes) > 1:
                    # Some outcome of the batch can never be written: find it, one at a time.
                    self.outcomes.extendleft(reversed(outcomes))
                    self._suspects = len(outcomes)
                    self.logger.warning(
                        "A batch of %d decisions with follow-ups was refused (%s: %s); writing them "
                        "one at a time",
                        len(outcomes),
                        type(e).__name__,
                        e,
                    )
                    continue
                finished = []
                try:
                    quarantined = self._quarantine(outcomes[0], e)
                except UNWRITABLE as again:
                    # Not even its dead letter can be written: let it go.  No longer tracked, the
                    # message is released by the orphan check and delivered again.
                    dropped = 1
                    self.logger.error(
                        "Message %d could not be quarantined (%s: %s); it will be delivered again",
                        outcomes[0].row_id,
                        type(again).__name__,
                        again,
                    )
                except Exception:
                    self.outcomes.appendleft(outcomes[0])
                    raise
            except Exception:
                self.outcomes.extendleft(reversed(outcomes))
                raise
            self._suspects = max(0, self._suspects - len(outcomes))
            self.runtime.untrack([o.fence() for o in outcomes])
            self._wrote(len(outcomes))
            done["acked"] += sum(o.kind in ("ack", "ack_with_error") for o in finished)
            done["nacked"] += sum(o.kind == "nack" for o in finished) + quarantined
            done["canceled"] += sum(o.kind == "cancel" for o in finished)
            stale = len(outcomes) - len(finished) - quarantined - dropped
            if stale:
                done["stale"] += stale
                self.logger.warning(
                    "%d stale decision(s) with follow-ups ignored, follow-ups included: their lease "
                    "expired and the message was released (it will be, or was, delivered again)",
                    stale,
                )
        notifier = self.notifier
        if notifier is not None:
            # A NOTIFY that failed, or whose connection broke, goes on a pooled connection.
            self.notifications.extend(notifier.collect(NOTIFY_REPLY_TIMEOUT))
        if self.notifications:
            queues = sorted({self.notifications.popleft() for _ in range(len(self.notifications))})
            try:
                with self.runtime.connection() as conn:
                    self.runtime.store.notify(conn, channel=self.runtime.channel, queue_names=queues)
            except Exception:
                self.notifications.extend(queues)
                raise
            if notifier is not None and not notifier.connected:
                try:
                    notifier.open()  # the server is back: the next wake-up is written at once again
                except psycopg.Error as e:
                    self.logger.debug("The wake-ups' connection could not be opened again: %s", e)
        if self.commit_notifications:
            self._notify_committed()
        for key, value in done.items():
            self.stats[key] += value
        return done

    def _notify_committed(self) -> None:
        pairs = [self.commit_notifications.popleft() for _ in range(len(self.commit_notifications))]
        try:
            with self.runtime.connection() as conn:
                rows = self.runtime.store.notify_committed(
                    conn,
                    channel=self.runtime.channel,
                    xids=[xid for xid, _ in pairs],
                    payloads=[payload for _, payload in pairs],
                )
        except Exception:
            self.commit_notifications.extendleft(reversed(pairs))
            raise
        waiting = [(row.xid, row.payload) for row in rows if row.status == "in progress"]
        if waiting:
            # Its COMMIT is on its way: look again at the next flush.
            self.commit_notifications.extend(waiting)
            self.wake()

    def _write(self, name: str, items: list[Any]) -> tuple[int, list[str]]:
        """Write one batch of a plain decision buffer: (rows written, queues to wake)."""
        runtime = self.runtime
        with runtime.connection() as conn:
            if name != "requeue":
                return self._archive(conn, name, items), []
            fence = fence_params(items)
            rows = runtime.store.requeue(
                conn,
                ids=fence["ids"],
                fences=fence["fences"],
                notify=runtime.broker.options.notify != "off",
                channel=runtime.channel,
            )
            return sum(row.n for row in rows), [row.queue_name for row in rows]

    def _archive(self, conn: psycopg.Connection[Any], kind: str, items: Sequence[Any]) -> int:
        """The fenced statement of one kind of decision for ``(row id, lease, error type, error)`` items.

        ``ack`` archives as completed; ``ack_with_error`` (completed), ``nack``
        (failed) and ``cancel`` (canceled) with their errors.  Returns the number of rows archived.
        """
        store = self.runtime.store
        fence = fence_params(items)
        if kind == "ack":
            return store.ack(conn, ids=fence["ids"], fences=fence["fences"])
        return store.archive(conn, **fence, **self._errors(kind, items))

    def _archive_fenced(self, conn: psycopg.Connection[Any], kind: str, items: Sequence[Any]) -> list[Fence]:
        """:meth:`_archive`, returning the ``Fence`` (id, lease) of each row archived."""
        store = self.runtime.store
        fence = fence_params(items)
        if kind == "ack":
            return store.ack_fenced(conn, ids=fence["ids"], fences=fence["fences"])
        return store.archive_fenced(conn, **fence, **self._errors(kind, items))

    @staticmethod
    def _errors(kind: str, items: Sequence[Any]) -> dict[str, Any]:
        """The archive's ``state``, ``error_types`` and ``errors`` for items of ``kind`` (not ``ack``)."""
        return {
            "state": {"nack": "failed", "cancel": "canceled"}.get(kind, "completed"),
            "error_types": [item[2] for item in items],
            "errors": [item[3] for item in items],
        }

    def _write_outcomes(self, outcomes: list[Outcome]) -> list[Outcome]:
        """Write decisions and their follow-ups in one transaction; the outcomes whose fence held.

        The fenced ack/archive statements return the (id, lease) of each row they
        archived; only those deliveries' follow-ups are written.  A stale decision
        (its message was released and will run again, or already runs under a new
        lease) takes its follow-ups with it, even when the current delivery of the
        same row is in the same batch, so they are written once, by the delivery
        that is acked.  ``after_enqueue`` runs for
        the stored follow-ups once the transaction has committed.
        """
        runtime = self.runtime
        broker = runtime.broker
        store = runtime.store
        with runtime.connection() as conn, conn.transaction():
            archived: set[Fence] = set()
            for kind in ("ack", "ack_with_error", "nack", "cancel"):
                group = [o.fence() for o in outcomes if o.kind == kind]
                if group:
                    archived.update(self._archive_fenced(conn, kind, group))
            written = [o for o in outcomes if (o.row_id, o.lease) in archived]
            messages = [m for o in written for m in o.messages]
            # Messages on a condition (a group's barrier count-down), in key order: two
            # transactions that count down the same barriers lock their rows in one order.
            conditions = sorted(
                (c for o in written for c in o.conditional), key=lambda c: str(c.statement.params)
            )
            for c in conditions:
                if store.holds(conn, c.statement):
                    messages.extend(c.messages)
            stored: list[StoredMessage] = []
            if messages:
                options = broker.options
                statement = enqueue_statement(
                    messages, runtime.channel, options.notify != "off", options.max_fetch_interval
                )
                stored = enqueue_result(
                    statement.name, messages, store.enqueue(conn.cursor(), statement)
                ).stored
            # Results: one executemany per statement text (psycopg pipelines it), not a
            # round trip per message.
            store.run_many(conn, [s for outcome in written for s in outcome.statements])
        for item in stored:
            broker.emit_after("enqueue", item.message, item.delay or None)
        return written

    def _quarantine(self, outcome: Outcome, error: Exception | None) -> int:
        """Archive the message of ``outcome`` as failed, none of its follow-ups written.

        Called when writing ``outcome`` alone failed with an :data:`UNWRITABLE`
        error (``error``): it would fail again at every retry and hold back every later
        outcome of the process; or, with ``error`` None, for an outcome with
        follow-ups refused when they were sent (``outcome.refused``: over
        ``max_message_bytes``).  Its message goes to history as failed, with
        ``error_type`` :data:`FOLLOW_UP_NOT_WRITABLE` and an error naming the
        follow-ups refused (by the database, each tried alone in a savepoint that
        is rolled back; or when sent) and the delivery's own outcome.

        Returns:
          int: 1 if the message was archived, 0 if its lease was stale.

        Raises:
          Exception: What the database raised; the caller keeps the outcome.
        """
        with self.runtime.connection() as conn, conn.transaction():
            refused = list(outcome.refused)
            writes = [] if refused else self._follow_up_writes(outcome)
            for what, statement in writes:
                try:
                    with conn.transaction():
                        self.runtime.store.run(conn, statement)
                        raise psycopg.Rollback()
                except UNWRITABLE as e:
                    refused.append(f"{what}: {type(e).__name__}: {e}")
            if not refused:  # refused together only
                refused = [what for what, _ in writes] + [f"together: {type(error).__name__}: {error}"]
            own = {
                "ack": "completed",
                "ack_with_error": "completed after an error",
                "nack": "failed",
                "cancel": "was canceled",
            }
            text = (
                "This delivery's follow-ups can never be written, so none of them was: "
                + "; ".join(refused)
                + f". The delivery itself {own.get(outcome.kind, outcome.kind)}"
                + (f" ({outcome.error_type}):\n{outcome.error}" if outcome.error else ".")
            )
            item = (outcome.row_id, outcome.lease, FOLLOW_UP_NOT_WRITABLE, clip_error(text))
            archived = len(self._archive_fenced(conn, "nack", [item]))
        if archived:
            self.logger.error(
                "Message %d quarantined as failed (%s), none of its follow-ups written: %s",
                outcome.row_id,
                FOLLOW_UP_NOT_WRITABLE,
                "; ".join(refused),
            )
        return archived

    def _follow_up_writes(self, outcome: Outcome) -> list[tuple[str, Statement]]:
        """(description, statement) of each follow-up of ``outcome`` written alone."""
        options = self.runtime.broker.options
        writes = []
        for item in outcome.messages:
            statement = enqueue_statement(
                [item], self.runtime.channel, options.notify != "off", options.max_fetch_interval
            )
            message = item.message
            what = (
                f"message {message.message_id} to actor {message.actor_name!r} "
                f"(queue {message.queue_name!r}, delay {item.delay} ms, "
                f"retries {message.options.get('retries', 0)})"
            )
            writes.append((what, self.runtime.store.enqueue_query(statement)))
        for write in outcome.statements:
            key = write.params.get("message_key")
            writes.append((f"the result {key!r}" if key is not None else "a write", write))
        return writes

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
        # A wake-up written on the notifier's connection: its reply, then the connection closed.
        notifier, self.notifier = self.notifier, None
        if notifier is not None:
            leftover = notifier.collect(max(0.0, grace - time.monotonic()))
            notifier.close()
            if leftover:
                self.notifications.extend(leftover)
                try:
                    self.flush_once()
                except Exception as e:
                    self.logger.debug("Wake-ups not sent before shutdown: %s", e)
        if self.pending():
            self.logger.error(
                "%d ack/nack/requeue decisions could not be written before shutdown; "
                "those messages will be released by the rescuer and delivered again",
                self.pending(),
            )
        self._urgent.set()
        super().stop(timeout)
