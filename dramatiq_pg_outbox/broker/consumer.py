"""The consumer side of :class:`~.broker.PostgresBroker`: claims, the hand-off, and the message being decided.

``PostgresConsumer`` runs Dramatiq's fetch loop (``__next__``, batched claims,
wake-ups) and takes acks and nacks from any thread; ``PostgresMessage`` is a
claimed message with its row id and lease; :func:`deciding` names the message
whose follow-ups this thread collects.  The consumer sees its broker through
:class:`ConsumerHost`, so this module never imports the broker's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol

from dramatiq import Message
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import DecodeError
from dramatiq.logging import get_logger

from .._runtime import SLOT_FREED, Conditional, ProcessRuntime, RuntimeHost, StoredMessage, format_error
from .._runtime.watermark import Watermark
from ..store.messages import LOOK_AHEAD, Claim, ClaimRow, QueueClaim, Statement


class ConsumerHost(RuntimeHost, Protocol):
    """What a consumer uses of its broker (:class:`~.broker.PostgresBroker`)."""

    @property
    def runtime(self) -> ProcessRuntime: ...


#: Delivery number from which a message runs alone in its consumer (or at its last allowed delivery).
SUSPECT_AT_DELIVERY = 3
#: Seconds a consumer's keyed claims skip the messages without a key after one found none
#: (a notification of a stored message, or one of its due times, ends it sooner).
UNKEYED_RECHECK_S = 1.0

#: Most consumers one claim serves: the consumer whose claim is due and that many others
#: of its process at most (see PostgresConsumer._partners).
MAX_CLAIMED_TOGETHER = 32

#: Per thread: the claimed message whose outcome this thread is deciding, if any.
_deciding = threading.local()
#: Per thread: the claimed message whose actor this thread runs, if any (see is_canceled).
_running = threading.local()

#: The values of the actor option ``cancel``: what an operator's cancel does to a running actor.
CANCEL_MODES = ("interrupt", "ask")


def is_canceled() -> bool:
    """Whether an operator canceled the message whose actor runs on this thread.

    For actors declared with ``cancel="ask"`` (never interrupted): poll it between
    steps and return once it is true; the delivery ends in history as ``canceled``,
    with no retry and no follow-ups, whether the actor returns or raises.  Becomes true
    within milliseconds of ``dramatiq-pg-outbox cancel`` (the broker's notification), or
    within ``heartbeat_interval`` ms without notifications (``listen=False``).  False
    outside an actor of a :class:`~dramatiq_pg_outbox.PostgresBroker` worker.

    Returns:
      bool: True once the cancel reached this worker process.
    """
    message: PostgresMessage | None = getattr(_running, "message", None)
    return message is not None and message.cancel_requested


def running_message(message: PostgresMessage | None) -> None:
    """Make ``message`` the one whose actor this thread runs (None: none), for :func:`is_canceled`."""
    _running.message = message


def deciding() -> PostgresMessage | None:
    """The message whose follow-ups this thread is collecting, if any.

    Set by :meth:`PostgresBroker.emit_after` while the ``after_process_message``,
    ``after_skip_message``, ``after_ack`` and ``after_nack`` hooks of a claimed
    message run on a worker thread; None elsewhere (in particular inside the
    actor's own body).  Its broker is ``message.consumer.broker``.
    """
    message: PostgresMessage | None = getattr(_deciding, "message", None)
    return message


def begin_deciding(message: PostgresMessage) -> PostgresMessage | None:
    """Make :func:`deciding` return ``message`` on this thread; the one it returned before.

    Pass that to :func:`end_deciding` in a ``finally``.  Two plain calls rather than a
    context manager: this runs twice per message on the hot path, and a generator-based
    ``contextlib.contextmanager`` costs about 1.4 us more per use (CPython 3.11).
    """
    previous: PostgresMessage | None = getattr(_deciding, "message", None)
    _deciding.message = message
    return previous


def end_deciding(previous: PostgresMessage | None) -> None:
    """Restore what :func:`deciding` returned before :func:`begin_deciding`."""
    _deciding.message = previous


#: A consumer's first buffer size, in multiples of Dramatiq's prefetch (the fixed size of
#: earlier versions): one notification's worth of messages due at once fits in it.
INITIAL_OVERFETCH = 4


def claim_limit(
    limit: int, floor: int, cap: int, *, backlog: bool, asked: int, claimed: int, held: int, left: int
) -> int:
    """A consumer's next buffer size, from what its last claim saw: halved, kept or doubled.

    With a backlog a consumer claims again when half its buffer is free, so the
    other half (``held`` messages, claimed earlier and not yet decided) keeps its
    worker threads busy during the claim's round trip.  ``left`` of them were still
    undecided when the claim returned.  A claim that filled (``claimed == asked``)
    after one that did too (``backlog``):

    * ``left`` under half the floor (fewer than Dramatiq's worker threads, whose
      prefetch is 2 x threads): threads ran dry while it was in flight: double;
    * more than three quarters of ``held`` left: tasks are long beside a round
      trip, and a buffer half the size would still cover it: halve;
    * otherwise keep.  A claim that did not fill, or the first of a backlog (it
      started from an idle buffer), says nothing of the pace: keep.

    Short tasks get large batched claims (the round trip of one claim is the
    drain's bottleneck, benchmarks/README.md section 19) while long tasks do not
    hoard messages another process could start.  The same multiplicative
    increase and decrease on a signal of starvation or slack as TCP's congestion
    window (RFC 5681), on the buffer of a queue consumer instead of a socket.

    Parameters:
      limit(int): The buffer size the claim was made with, messages.
      floor(int), cap(int): Bounds of the result, messages, 1 <= floor <= cap.
      backlog(bool): Whether the claim before it filled.
      asked(int), claimed(int): Rows the claim asked for and got.
      held(int), left(int): Undecided messages when it was sent and when it returned.

    Returns:
      int: The next buffer size, within [floor, cap].
    """
    if claimed < asked or not backlog:
        return limit
    if 2 * left < floor:
        return min(cap, 2 * limit)
    if held and 4 * left > 3 * held:
        return max(floor, limit // 2)
    return limit


def _hand_off_order(row: ClaimRow) -> tuple[int, int]:
    """Highest ``broker_priority`` first, then oldest (lowest row id)."""
    return -row.priority, row.id


class _ClaimStart(NamedTuple):
    """What a consumer's claim was started with (see PostgresConsumer._start): its finish needs it."""

    limit: int
    on_time: bool
    sent: float
    held: int
    sweep: bool
    bound: dict[str, Any]
    scan_unkeyed: bool
    prioritize_calls: int


class PostgresMessage(MessageProxy):
    """A claimed message: carries its row id and lease for fenced acks."""

    def __init__(
        self, message: Message[Any], row_id: int, lease: uuid.UUID, attempts: int, consumer: PostgresConsumer
    ) -> None:
        super().__init__(message)
        # Message's fields as attributes of the proxy: Dramatiq's worker and middleware read
        # them about 21 times per message, each through MessageProxy.__getattr__ (a Python
        # call).  Message is frozen, so these stay its fields (the options dict is the same one).
        self.queue_name = message.queue_name
        self.actor_name = message.actor_name
        self.args = message.args
        self.kwargs = message.kwargs
        self.options = message.options
        self.message_id = message.message_id
        self.message_timestamp = message.message_timestamp
        #: The consumer that claimed it: its buffer slot is freed on ack, even when
        #: Dramatiq acks through a consumer restarted after a connection error.
        self.consumer = consumer
        self.row_id = row_id
        self.lease = lease
        #: Claims of this stored message so far, this one included.
        self.attempts = attempts
        #: Messages enqueued by middleware while its outcome is decided (see PostgresBroker.emit_after).
        self.follow_ups: list[StoredMessage] = []
        #: Other writes of that phase (results).
        self.statements: list[Statement] = []
        #: Messages of that phase written only if a statement returns true (see :meth:`sending_if`).
        self.conditional: list[Conditional] = []
        #: Follow-ups refused at send time (over ``max_message_bytes``): why, one line each.
        #: Any makes the flusher quarantine the message, none of its follow-ups written.
        self.refused: list[str] = []
        #: Where the broker puts what is sent now: ``follow_ups``, or a conditional's messages.
        self.sending_to: list[StoredMessage] = self.follow_ups
        #: Set by emit_before("ack"/"nack"): the decision waits for emit_after.
        self.deferred = False
        #: The decision taken by ack or nack: (kind, error type, error).
        self.outcome: tuple[str, str | None, str | None] | None = None
        #: Whether it has a concurrency key: its end frees a slot, and wakes the queue's consumers.
        self.keyed = False
        #: Set by the runtime when an operator's cancel of this delivery reached the process
        #: (see ProcessRuntime.request_cancel): its outcome is ``cancel``, whatever the actor did.
        self.cancel_requested = False

    @contextlib.contextmanager
    def sending_if(self, statement: Statement) -> Iterator[None]:
        """While open, the broker's sends in the outcome's hooks are written only if ``statement`` holds.

        ``statement`` runs in the transaction of the outcome, after its fenced archive
        (see :class:`~dramatiq_pg_outbox._runtime.Conditional`).
        """
        conditional = Conditional(statement)
        self.conditional.append(conditional)
        self.sending_to = conditional.messages
        try:
            yield
        finally:
            self.sending_to = self.follow_ups


class PostgresConsumer(Consumer):
    """Fetch loop + hand-off.  ``__next__`` runs on Dramatiq's consumer thread
    and claims in batches; ack/nack may come from any thread.

    An idle consumer claims again at the earliest of: its poll deadline
    (``max_fetch_interval`` after the last claim); the due time of the
    queue's earliest delayed row, which every claim returns, or of a
    ``"<queue>@<due>"`` notification, if that due time is this consumer's
    (see ``_mine``); at once on a ``"<queue>"`` notification or when a slot
    frees up.
    """

    def __init__(self, broker: ConsumerHost, queue_name: str, prefetch: int, timeout: int) -> None:
        self.logger = get_logger(__name__, type(self))
        self.broker = broker
        self.runtime = broker.runtime
        self.queue_name = queue_name
        self.timeout = timeout
        prefetch = max(prefetch, 1)
        #: Bounds of ``limit``: prefetch x overfetch_factor at most, Dramatiq's prefetch (or
        #: that cap, if lower) at least.
        self._cap = max(1, math.ceil(prefetch * broker.options.overfetch_factor))
        self._floor = min(prefetch, self._cap)
        #: Most claimed, unacknowledged messages held now (see claim_limit): it starts at
        #: 4 x prefetch (within the bounds) and adapts after each claim of a backlog.
        #: Changed by the consumer thread only, under _lock (_release reads it there).
        self.limit = min(self._cap, INITIAL_OVERFETCH * prefetch)
        self._buffer: deque[PostgresMessage] = deque()
        self._outstanding = 0
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._notified = False
        self._more = False
        #: Whether the queue had prioritized rows pending at the last claim (the first claim
        #: assumes so): then it claims with claim_prioritized, else with the plain claim.
        self._prioritized = True
        #: Count of prioritize() calls: one during a claim keeps _prioritized set whatever that
        #: claim's snapshot said (its message may have committed after the snapshot).
        self._prioritize_calls = 0
        #: Whether the queue had messages with a concurrency key pending at the last claim:
        #: then it claims with claim_keyed.  The first claim is a plain one, which claims
        #: again at once if it finds keyed messages pending.
        self._keyed = False
        #: Where the next keyed claim's walk over the keys starts (Claim.next_key).
        self._next_key: str | None = None
        #: time.monotonic() until which keyed claims skip the messages without a key: the
        #: last one found none (see claim_keyed).  A notification of a stored message, a due
        #: time of ours or UNKEYED_RECHECK_S end it.  Consumer thread, and notify().
        self._skip_unkeyed_until = 0.0
        #: time.monotonic() of the next poll (or refill, with a backlog).  Consumer thread only.
        self._poll_at = 0.0
        #: time.monotonic() at which the earliest delayed row that the last claim
        #: reported falls due, if that due time is ours (inf: none).  Consumer thread only.
        self._due_at = math.inf
        #: time.monotonic() of the earliest due time of ours announced by a
        #: "<queue>@<due>" notification since the last claim began (inf: none).
        #: Lowered by the listener thread, reset by the consumer thread, under _lock.
        self._due_hint = math.inf
        #: Live worker processes consuming this queue, and this one's rank among
        #: them (see _mine); refreshed every heartbeat_interval, after a claim.
        self._consumers = 1
        self._rank = 0
        self._rank_at = 0.0
        #: Claims made, and claims that returned no message (see docs/design.md, "Delays").
        self.claims = 0
        self.empty_claims = 0
        #: Of ``claims``: those another consumer of this process made for this one in its own
        #: statement (see _partners); and the statements of this one's that claimed for others too.
        self.claimed_by_others = 0
        self.claims_together = 0
        #: Held by whoever claims for this consumer: its own thread, or another consumer of the
        #: process claiming for it in the same statement (acquired without waiting, see _partners).
        self._claim_lock = threading.Lock()
        #: Deliveries from which a message runs alone (see _isolate).
        self._suspect_at = min(SUSPECT_AT_DELIVERY, broker.options.max_deliveries)
        #: Row id of a redelivered message running alone (see _isolate).
        self._isolated: int | None = None
        #: Where its claims start reading (issue 20; see the claim in queries.sql).
        self.watermark = Watermark()
        self._closed = False
        self.runtime.register(self)

    def notify(self) -> None:
        """Called by the listener: something may be ready now."""
        self._notified = True
        self._skip_unkeyed_until = 0.0  # a message may have been stored without a key
        # What was stored or released may lie behind the watermark: sweep soon.
        self.watermark.owe_sweep()
        self._wakeup.set()

    @property
    def outstanding(self) -> int:
        """Messages this consumer claimed and not yet acked, nacked or handed back (its slots in use)."""
        return self._outstanding

    def slot_freed(self) -> None:
        """Called by the listener: a message with a concurrency key of this queue finished
        (``<queue>~``): claim again, its key has a free slot; nothing new was stored."""
        self._notified = True
        self._wakeup.set()

    def prioritize(self) -> None:
        """Called by the listener: a message with a ``broker_priority`` was stored; claim those first."""
        self._prioritize_calls += 1
        self._prioritized = True

    def notify_due(self, due_ms: int, at: float) -> None:
        """Called by the listener: a delayed message falls due.

        Moves the next claim earlier, never later, and claims nothing before
        then; ignored if the due time is another consumer's (see ``_mine``).

        Parameters:
          due_ms(int): The due time, epoch milliseconds on the database clock.
          at(float): The same instant on this process's ``time.monotonic()``, in seconds.
        """
        if not self._mine(due_ms):
            return
        with self._lock:
            if at >= self._due_hint:
                return
            self._due_hint = at
        self._wakeup.set()

    def _mine(self, due_ms: int) -> bool:
        """Whether this consumer wakes for a due time: one of the queue's consumers does.

        Every consumer waking at every due time would make each delayed
        message cost one claim per worker process, all but one of them empty
        (a thundering herd).  Due times are dealt out by ``due_ms mod n ==
        rank`` among the n live processes of the queue; the others find the
        message at their next poll if the one dealt it cannot claim it.
        """
        return self._consumers <= 1 or due_ms % self._consumers == self._rank

    def __next__(self) -> MessageProxy | None:
        deadline = time.monotonic() + self.timeout / 1000
        while True:
            if self._buffer:
                return self._buffer.popleft()
            if self._closed:
                return None
            # Cleared before the conditions are read: a notify, notify_due or
            # release that lands after this line interrupts the wait below.
            self._wakeup.clear()
            claims = self.claims
            free = self.limit - self._outstanding
            can_fetch = free >= self._threshold() and self._isolated is None
            due_at = min(self._due_at, self._due_hint)
            fetch_at = min(self._poll_at, due_at, self.watermark.wake_at())
            now = time.monotonic()
            if can_fetch and (self._notified or now >= fetch_at):
                if not self._claim_lock.acquire(blocking=False):
                    # Another consumer of this process is claiming for this one: wait, look again.
                    with self._claim_lock:
                        pass
                    continue
                try:
                    if self.claims != claims:
                        continue  # Claimed for since the conditions were read: read them again.
                    on_time = not self._notified and now >= due_at
                    self._notified = False
                    # Whatever was announced so far is committed, so this claim sees it.
                    with self._lock:
                        self._due_hint = math.inf
                    self._fetch(free, on_time)
                finally:
                    self._claim_lock.release()
                continue
            wait_until = min(deadline, fetch_at) if can_fetch else deadline
            remaining = wait_until - time.monotonic()
            if remaining <= 0:
                if time.monotonic() >= deadline:
                    return None
                continue
            self._wakeup.wait(remaining)

    def _threshold(self) -> int:
        # With a backlog, wait for half the buffer to drain so claims stay batched;
        # when idle, fetch as soon as one slot is free (latency).
        return max(1, self.limit // 2) if self._more else 1

    def _fetch(self, limit: int, on_time: bool = False) -> int:
        """Claim up to ``limit`` messages into the buffer and plan the next claim.

        A plain claim (not keyed, not prioritized) also claims, in the same statement
        (``claim_queues``), for the other consumers of the process whose own claim is due
        (see :meth:`_partners`).  Called with ``_claim_lock`` held.

        Parameters:
          limit(int): Most messages to claim.
          on_time(bool): Whether a due time of ours, not a poll or a notification, started this claim.

        Returns:
          int: Messages claimed (including any handed back by ``_isolate``).
        """
        partners = self._partners() if self._plain() else []
        if partners:
            return self._fetch_together(limit, on_time, partners)
        start = self._start(limit, on_time)
        lease = uuid.uuid4()
        runtime = self.runtime
        with runtime.connection() as conn:
            claim = runtime.store.claim(
                conn,
                prioritized=self._prioritized,
                queue_name=self.queue_name,
                limit=limit,
                lease=lease,
                owner=runtime.worker_id,
                consumers=self._consumers,
                rank=self._rank,
                look_ahead=LOOK_AHEAD,
                from_at=start.bound["from_at"],
                from_id=start.bound["from_id"],
                keyed=self._keyed,
                after_key=self._next_key,
                unkeyed=start.scan_unkeyed,
            )
        return self._finish(start, claim, lease)

    def _plain(self) -> bool:
        """Whether this consumer's next claim is the plain one (``claim``): no keys, no priorities."""
        return not self._keyed and not self._prioritized and self._isolated is None and not self._closed

    def _claim_due(self, now: float) -> bool:
        """Whether this consumer would claim at ``now``, or its poll is less than half an interval away.

        Read by another consumer's thread (see _partners): a stale value costs a claim of
        nothing or a claim left to this consumer's own thread, never a slot.
        """
        free = self.limit - self._outstanding
        if free < self._threshold() or self._isolated is not None:
            return False
        if self._notified or now >= min(self._due_at, self._due_hint, self.watermark.wake_at()):
            return True
        # An idle poll that is soon due rides along, so the polls of a process's consumers
        # fall together; a backlog's refill is due at _poll_at itself (min_fetch_interval).
        slack = 0.0 if self._more else self.broker.options.max_fetch_interval / 2000
        return now + slack >= self._poll_at

    def _partners(self) -> list[tuple[PostgresConsumer, int, bool]]:
        """The other consumers of this process to claim for in this claim, their claim locks held.

        Each is plain, of another queue, and its own claim is due (see _claim_due); its
        claim lock is taken without waiting (one whose own thread, or another consumer,
        is claiming for it is left alone).  Its notification and due-time hint are taken
        as its own thread takes them before a claim.  Returns (consumer, limit, on_time).
        """
        chosen: list[tuple[PostgresConsumer, int, bool]] = []
        names = {self.queue_name}
        now = time.monotonic()
        for other in self.runtime.registered():
            if not isinstance(other, PostgresConsumer) or other.queue_name in names or not other._plain():
                continue
            if other.runtime is not self.runtime or not other._claim_due(now):
                continue
            if not other._claim_lock.acquire(blocking=False):
                continue
            if not other._plain() or not other._claim_due(now):
                other._claim_lock.release()
                continue
            on_time = not other._notified and now >= min(other._due_at, other._due_hint)
            other._notified = False
            with other._lock:
                other._due_hint = math.inf
            chosen.append((other, other.limit - other._outstanding, on_time))
            names.add(other.queue_name)
            if len(chosen) >= MAX_CLAIMED_TOGETHER:
                break
        return chosen

    def _fetch_together(
        self, limit: int, on_time: bool, partners: list[tuple[PostgresConsumer, int, bool]]
    ) -> int:
        """This consumer's plain claim and its partners' in one statement (``claim_queues``).

        Each queue gets its own limit (the free slots of its consumer), watermark and rank,
        and each consumer's state is then updated as its own claim would (see _finish).
        Releases the partners' claim locks.
        """
        runtime = self.runtime
        done = False
        try:
            starts = [(self, self._start(limit, on_time))]
            starts += [(other, other._start(free, other_on_time)) for other, free, other_on_time in partners]
            lease = uuid.uuid4()
            queues = [
                QueueClaim(
                    c.queue_name, s.limit, s.bound["from_at"], s.bound["from_id"], c._consumers, c._rank
                )
                for c, s in starts
            ]
            with runtime.connection() as conn:
                claims = runtime.store.claim_queues(
                    conn, queues, lease=lease, owner=runtime.worker_id, look_ahead=LOOK_AHEAD
                )
            done = True
            self.claims_together += 1
            claimed = 0
            for consumer, start in starts:
                count = consumer._finish(start, claims[consumer.queue_name], lease, rank=False)
                if consumer is self:
                    claimed = count
                else:
                    consumer.claimed_by_others += 1
                    if count:
                        consumer._wakeup.set()  # Its rows are in its buffer: hand them on now.
            now = time.monotonic()
            due = [consumer for consumer, _ in starts if consumer._rank_due(now)]
            if due:
                self._refresh_ranks(due)
            return claimed
        finally:
            for other, _, _ in partners:
                if not done:
                    other._notified = True  # Its claim failed here: its own thread claims.
                other._claim_lock.release()
                other._wakeup.set()

    def _start(self, limit: int, on_time: bool) -> _ClaimStart:
        """What a claim of up to ``limit`` messages starts from: the watermark's bound, what is held."""
        sent = time.monotonic()
        with self._lock:
            held = self._outstanding
        sweep, bound = self.watermark.start(sent)
        scan_unkeyed = on_time or sent >= self._skip_unkeyed_until
        return _ClaimStart(limit, on_time, sent, held, sweep, bound, scan_unkeyed, self._prioritize_calls)

    def _finish(self, start: _ClaimStart, claim: Claim, lease: uuid.UUID, *, rank: bool = True) -> int:
        """Take the rows of a claim into the buffer and plan the next claim (the rest of _fetch).

        ``rank``: refresh the rank here when it is due (False: the caller refreshes it, see
        _fetch_together).
        """
        limit, on_time, sent, held = start.limit, start.on_time, start.sent, start.held
        sweep, scan_unkeyed, prioritize_calls = start.sweep, start.scan_unkeyed, start.prioritize_calls
        metrics = self.broker._metrics
        runtime = self.runtime
        next_due_in_ms = claim.next_due_in_ms
        # Messages with a concurrency key appeared since the last (plain) claim: claim again at once.
        newly_keyed = claim.keyed and not self._keyed
        if not claim.keyed or any(not row.row_keyed for row in claim.rows):
            self._skip_unkeyed_until = 0.0
        elif scan_unkeyed and self._keyed and len(claim.rows) < limit:
            # A keyed claim looked for messages without a key and found none: skip them a while.
            self._skip_unkeyed_until = sent + UNKEYED_RECHECK_S
        self._keyed, self._next_key = claim.keyed, claim.next_key
        # While the queue has prioritized rows pending, claim them first (see the claim in queries.sql).
        self._prioritized = claim.prioritized or self._prioritize_calls != prioritize_calls
        runtime.observe_clock(claim.db_now_ms, sent)
        # Highest priority first, then oldest: the worker runs them in hand-off order.
        rows = sorted(claim.rows, key=_hand_off_order)
        # Rows with a broker_priority move no watermark: claim_prioritized takes them
        # first, from their own index, whatever their due time.
        self.watermark.claimed(
            [(row.due_at, row.id) for row in rows if row.priority == 0 and not row.row_keyed],
            full=len(rows) >= limit,
            sweep=sweep,
            sent=sent,
        )
        if metrics is not None:
            metrics.claim_seconds.labels(self.queue_name).observe(time.monotonic() - sent)
            if rows:
                metrics.claimed.labels(self.queue_name).inc(len(rows))
        self.claims += 1
        self.empty_claims += not rows
        backlog, self._more = self._more, len(rows) >= limit
        with self._lock:
            left = self._outstanding
            self.limit = claim_limit(
                self.limit,
                self._floor,
                self._cap,
                backlog=backlog,
                asked=limit,
                claimed=len(rows),
                held=held,
                left=left,
            )
        now = time.monotonic()
        options = self.broker.options
        interval = options.min_fetch_interval if self._more else options.max_fetch_interval
        self._poll_at = now if newly_keyed else now + interval / 1000
        if rank and self._rank_due(now):
            self.refresh_rank()
        # The claim returned our next due time (see _mine), relative to its now(),
        # which is ~one-way latency after `sent`: sent at sent + next_due_in, the
        # next claim reaches the server when the row is due.
        self._due_at = math.inf if next_due_in_ms is None else sent + next_due_in_ms / 1000
        if on_time and self._more and self._consumers > 1 and self.broker.options.notify != "off":
            # More became due at once than this consumer can take: wake the others.
            self.runtime.flusher.notify_later([self.queue_name])
        self.runtime.track([row.id for row in rows], lease)
        suspects = [row for row in rows if row.attempts >= self._suspect_at]
        if suspects:
            rows = self._isolate(suspects[0], [row for row in rows if row is not suspects[0]], lease)
        for row in rows:
            row_id = row.id
            try:
                message = Message.decode(bytes(row.payload))
            except DecodeError as e:
                self.logger.error(
                    "Dead-lettering undecodable message %d of queue %r: %s", row_id, self.queue_name, e
                )
                _, error = format_error(e.__cause__ or e)
                self.runtime.flusher.nack(row_id, lease, "DecodeError", error)
                if row_id == self._isolated:
                    self._isolated = None
                continue
            if message.queue_name != self.queue_name:
                message = dataclasses.replace(message, queue_name=self.queue_name)
            with self._lock:
                self._outstanding += 1
            proxy = PostgresMessage(message, row_id, lease, row.attempts, self)
            proxy.keyed = bool(row.row_keyed)
            self._buffer.append(proxy)
        return len(rows)

    @property
    def next_claim_at(self) -> float:
        """When this consumer plans its next claim, in ``time.monotonic()`` seconds.

        The earlier of its poll deadline (``max_fetch_interval`` after the last claim)
        and the due time of the next delayed message it saw; a notification, a
        watermark wake-up or a due-time hint from a send can bring a claim forward.
        """
        return min(self._poll_at, self._due_at)

    @property
    def rank(self) -> tuple[int, int]:
        """``(consumers, rank)``: live processes consuming this queue, and this one's rank among them.

        A delayed message due at ``due_ms`` wakes the process whose rank is
        ``due_ms % consumers`` (``(1, 0)`` until this process's heartbeat lists the
        queue).  Learnt once per ``heartbeat_interval``, or by :meth:`refresh_rank`.
        """
        return self._consumers, self._rank

    def _rank_due(self, now: float) -> bool:
        """Whether this consumer's rank is to be learnt again (idle, once per heartbeat_interval)."""
        return not self._more and now >= self._rank_at

    def _refresh_ranks(self, consumers: list[PostgresConsumer]) -> None:
        """:meth:`refresh_rank` of one or several consumers of this process, in one statement."""
        options = self.broker.options
        rank_at = time.monotonic() + options.heartbeat_interval / 1000
        with self.runtime.connection() as conn:
            found = self.runtime.store.consumer_rank(
                conn,
                queue_names=[c.queue_name for c in consumers],
                worker_id=self.runtime.worker_id,
                heartbeat_timeout_ms=options.heartbeat_timeout,
            )
        for consumer in consumers:
            rank = found.get(consumer.queue_name)
            consumer._rank_at = rank_at
            # Not listed yet (the heartbeat that names this queue is still to come): wake for all.
            consumer._consumers, consumer._rank = (
                (rank.consumers, rank.rank) if rank and rank.listed else (1, 0)
            )

    def refresh_rank(self) -> None:
        """Learn how many live processes consume this queue and this one's rank (see ``_mine``)."""
        self._refresh_ranks([self])

    def _isolate(self, suspect: ClaimRow, others: list[ClaimRow], lease: uuid.UUID) -> list[ClaimRow]:
        """Run a message alone from its third (or its last allowed) delivery.

        A message claimed twice before without an ack may be what killed its
        workers.  Every message a dying process holds is charged an attempt,
        so running a suspect beside others would push innocent messages
        towards ``max_deliveries``; running it alone means only the suspect
        pays for its own crashes.  The rest of this claim is handed back at
        once (refunded) and this consumer claims nothing more until the
        suspect is acked or nacked.  (RabbitMQ quorum queues' delivery-limit
        charges every unacked message of a dead channel alike, with no such
        protection.)
        """
        if others:
            self.runtime.flusher.requeue_now([(row.id, lease) for row in others])
            if self.broker._metrics is not None:
                self.broker._metrics.requeued.labels(self.queue_name).inc(len(others))
        self.logger.info(
            "Message %d of queue %r is on delivery %d: running it alone",
            suspect.id,
            self.queue_name,
            suspect.attempts,
        )
        self._isolated = suspect.id
        return [suspect]

    def _release(self, row_id: int) -> None:
        """Free the buffer slot of a message this consumer claimed (ack, nack or requeue)."""
        with self._lock:
            self._outstanding -= 1
            free = self.limit - self._outstanding
        if row_id == self._isolated:
            self._isolated = None
            self._wakeup.set()
        elif free == self._threshold():
            # Just crossed the refill threshold: let __next__ claim now.
            self._wakeup.set()

    def ack(self, message: MessageProxy) -> None:
        assert isinstance(message, PostgresMessage)
        exception = getattr(message, "_exception", None)
        if message.cancel_requested:
            self._canceled(message, exception)
            return
        if exception is None:
            message.outcome = ("ack", None, None)
        else:
            # The actor raised but Dramatiq acks: Retries enqueued a retry (a
            # follow-up of this outcome).  Keep the error in history.
            message.outcome = ("ack_with_error", *format_error(exception))
        self._decided(message)
        if self.broker._metrics is not None:
            self.broker._metrics.acked.labels(self.queue_name).inc()

    def nack(self, message: MessageProxy) -> None:
        assert isinstance(message, PostgresMessage)
        if message.cancel_requested:
            self._canceled(message, getattr(message, "_exception", None))
            return
        message.outcome = ("nack", *format_error(getattr(message, "_exception", None)))
        self._decided(message)
        if self.broker._metrics is not None:
            self.broker._metrics.nacked.labels(self.queue_name).inc()

    def _canceled(self, message: PostgresMessage, exception: BaseException | None) -> None:
        """Decide a delivery an operator canceled while it ran: archived as canceled.

        The error is where the actor stopped (the traceback of its exception); the
        archive adds the operator's reason.  None of its follow-ups is written (see submit).
        """
        if exception is None:
            error = 'its actor returned after the cancel (cancel="ask")'
        else:
            error = format_error(exception)[1]
        message.outcome = ("cancel", "Canceled", error)
        self._decided(message)
        if self.broker._metrics is not None:
            self.broker._metrics.nacked.labels(self.queue_name).inc()

    def _decided(self, message: PostgresMessage) -> None:
        message.consumer._release(message.row_id)
        if message.keyed:
            # A slot of its key frees when this decision is written: the flusher sends this
            # notification after it, and the queue's consumers claim what waited for the slot
            # ("~": nothing new was stored, see slot_freed).
            self.runtime.flusher.notify_later([f"{self.queue_name}{SLOT_FREED}"])
        if not message.deferred:
            # Called outside Dramatiq's worker (no emit_before): write it now.
            self.submit(message)

    def submit(self, message: PostgresMessage) -> None:
        """Hand a decided message, with its follow-ups, to the flusher.

        A canceled delivery's messages (the retry, callbacks, the pipeline's next step,
        a group's completion) are dropped; its other writes (the result backend's
        failure, for a waiter) are kept.
        """
        assert message.outcome is not None
        follow_ups, statements, conditional = message.follow_ups, message.statements, message.conditional
        refused = message.refused
        if message.outcome[0] == "cancel":
            follow_ups, conditional, refused = [], [], []
        message.follow_ups, message.statements, message.conditional = [], [], []
        message.refused = []
        message.sending_to = message.follow_ups
        self.runtime.flusher.finish(
            message.row_id, message.lease, *message.outcome, follow_ups, statements, conditional, refused
        )

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Hand unstarted messages back at once, without charging them an attempt."""
        claimed = [m for m in messages if isinstance(m, PostgresMessage)]
        if not claimed:
            return
        for message in claimed:
            message.consumer._release(message.row_id)
        self.runtime.flusher.requeue_now([(m.row_id, m.lease) for m in claimed])
        if self.broker._metrics is not None:
            self.broker._metrics.requeued.labels(self.queue_name).inc(len(claimed))

    def close(self) -> None:
        if self._closed:
            return
        # Not while another consumer claims for this one: its rows would land in a closed buffer.
        with self._claim_lock:
            self._closed = True
        self.runtime.unregister(self)
        unstarted = list(self._buffer)
        self._buffer.clear()
        self.requeue(unstarted)
