"""The scheduler (a Service: each tick enqueued once, by whichever process claims it) and its middleware."""

from __future__ import annotations

import datetime as dt
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.logging import get_logger
from dramatiq.middleware import Middleware

from .._runtime import Service, StoredMessage, enqueue_result, enqueue_statement
from ..broker import PostgresBroker
from ..broker.concurrency import apply_actor_options
from ..store.periodic import PeriodicStore, Rules

if TYPE_CHECKING:
    from dramatiq import Broker, Worker


from .schedules import (
    CLAIM_BATCH,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_REMOVED_AFTER,
    DEFAULT_SYNC_INTERVAL,
    LOCKED_RETRY,
    ONE_MS,
    REMOVED_RETENTION,
    Schedule,
    declared_schedules,
    format_tick,
)


@dataclass(frozen=True)
class PassResult:
    """Counts from one pass of a scheduler (:meth:`Scheduler.run_once`)."""

    #: Schedules claimed (due and not held by another scheduler).
    claimed: int
    #: Messages stored.
    enqueued: int
    #: Ticks that got no message of their own (the missed policy).
    missed: int
    #: Messages refused because their tick's key was already taken (expected: 0).
    duplicates: int


@dataclass(frozen=True)
class SyncResult:
    """Counts from one :meth:`Scheduler.sync`."""

    #: Schedules stored for the first time.
    added: int
    #: Schedules whose rule changed (they restart at their next tick).
    changed: int
    #: Removed schedules declared again (they restart at their next tick).
    revived: int
    #: Schedules no scheduler declared for ``removed_after``, marked removed now.
    removed: int
    #: Removed schedules deleted now (``REMOVED_RETENTION`` after their removal).
    deleted: int


class Scheduler(Service):
    """Enqueues the ticks of an application's schedules; run any number of them.

    Parameters:
      broker(PostgresBroker): Where the messages and the ``schedules`` table are.
      schedules(Iterable[Schedule]): Schedules besides those of ``@periodic`` on
        the broker's actors.  Default none.
      poll_interval(int): Longest sleep between passes, in milliseconds, >= 1.
        Default 5000.  (A scheduler sleeps until its next tick; this bounds it.)
      sync_interval(int): Period of the refresh that marks this scheduler's
        schedules as declared, in milliseconds, >= 1.  Default 60000.
      removed_after(int): A schedule that no running scheduler declared for this
        long is marked removed, in milliseconds, at least 2 x ``sync_interval``.
        Default 600000.  A scheduler marks none before it has run this long
        itself, so after an outage the other applications' schedulers of the
        same schema have time to come back.
      idle_timeout(int): Longest time a pass's transaction may sit idle
        (``idle_in_transaction_session_timeout``), in milliseconds, >= 1.
        Default 10000.  A scheduler whose host vanishes mid-pass (power loss,
        network partition) holds its schedules' row locks until the server
        notices; this makes that at most ``idle_timeout``, after which another
        scheduler takes the tick.  Keep it above the time a pass needs
        (``before_enqueue`` middleware included).

    Raises:
      TypeError: If ``broker`` is not a PostgresBroker.
      ValueError: For an option out of range, or a bad schedule (see
        :func:`declared_schedules`).
    """

    name = "scheduler"

    def __init__(
        self,
        broker: PostgresBroker,
        schedules: Iterable[Schedule] = (),
        *,
        poll_interval: int = DEFAULT_POLL_INTERVAL,
        sync_interval: int = DEFAULT_SYNC_INTERVAL,
        removed_after: int = DEFAULT_REMOVED_AFTER,
        idle_timeout: int = DEFAULT_IDLE_TIMEOUT,
    ) -> None:
        if not isinstance(broker, PostgresBroker):
            raise TypeError(f"A Scheduler needs a PostgresBroker, not {type(broker).__name__}.")
        numbers = (
            ("poll_interval", poll_interval),
            ("sync_interval", sync_interval),
            ("idle_timeout", idle_timeout),
        )
        for option, value in numbers:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{option} must be a whole number of milliseconds >= 1, not {value!r}")
        if (
            not isinstance(removed_after, int)
            or isinstance(removed_after, bool)
            or removed_after < 2 * sync_interval
        ):
            raise ValueError(
                f"removed_after must be a whole number of milliseconds of at least 2 x sync_interval "
                f"({2 * sync_interval}), not {removed_after!r}"
            )
        super().__init__(poll_interval / 1000)
        self.broker = broker
        self.poll_interval = poll_interval
        self.sync_interval = sync_interval
        self.removed_after = removed_after
        self.idle_timeout = idle_timeout
        #: The schedules of this scheduler, by name.
        self.schedules = declared_schedules(broker, schedules)
        ordered = list(self.schedules.values())
        #: The declared rules, as the parallel arrays of the periodic_* queries.
        self._rules = Rules(
            names=[s.key for s in ordered],
            crons=[s.cron for s in ordered],
            every_ms=[s.every for s in ordered],
            tzs=[s.tz for s in ordered],
        )
        self._store = PeriodicStore(broker.schema)
        self._created = time.monotonic()
        self._defined = False
        self._next_sync = 0.0
        #: Totals since start: enqueued, missed, duplicates, passes.
        self.stats = {"enqueued": 0, "missed": 0, "duplicates": 0, "passes": 0}

    def __repr__(self) -> str:
        return f"<Scheduler {len(self.schedules)} schedule(s) on {self.broker!r}>"

    # -- the loop (a Service: start, stop, run_forever; ticked after each iteration) ------
    def request_stop(self) -> None:
        """Ask :meth:`run` to return after the current pass (safe in a signal handler)."""
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        """Sync, then pass and sleep until the next tick, until :meth:`stop`.

        Database errors are logged and retried with backoff (100 ms doubling up to
        ``poll_interval``), never raised.
        """
        self.run_forever()

    def tick(self) -> PassResult | None:
        """One iteration: sync when due, then passes until a pass claims less than a batch."""
        if not self._defined or time.monotonic() >= self._next_sync:
            self.sync(define=not self._defined)
            self._next_sync = time.monotonic() + self.sync_interval / 1000
        result = None
        while not self.stopping:
            result = self.run_once()
            if result.claimed < CLAIM_BATCH:
                break
        return result

    def next_delay(self) -> float:
        return self._wait(self._next_sync)

    def log_failure(self, error: Exception, delay: float) -> None:
        self.logger.warning(
            "Scheduler pass failed (attempt %d), retrying in %.2fs: %s", self.failures, delay, error
        )

    def _wait(self, next_sync: float) -> float:
        """Seconds to sleep: until the next tick, at most poll_interval and until the next sync."""
        if self.schedules:
            due_in = self.next_due_in()
        else:
            due_in = None
        if due_in is None:
            wait_ms = float(self.poll_interval)
        elif due_in <= 0:
            # Due but not claimed: another scheduler holds it and is committing.
            wait_ms = LOCKED_RETRY * random.uniform(0.5, 1.5)
        else:
            # +1: the figure is floored to the server's microsecond; never wake early.
            wait_ms = min(float(self.poll_interval), due_in + 1)
        return max(0.0, min(wait_ms / 1000, next_sync - time.monotonic()))

    # -- one step at a time (testable without threads) ------------------------
    def sync(self, *, define: bool = True) -> SyncResult:
        """Write (``define``) or refresh this scheduler's schedules; mark and delete removed ones.

        Parameters:
          define(bool): Write the declared definitions (at start); False only
            marks the schedules whose rule matches as seen (the periodic refresh).

        Raises:
          SchemaNotReady: If the tables are missing or older than revision 6.
          ConnectionClosed/ConnectionFailed: If the database cannot be reached.
        """
        ordered = list(self.schedules.values())
        with self.broker.runtime.connection() as conn, conn.transaction():
            now = self._begin(conn)
            rows = self._store.declare(
                conn,
                rules=self._rules,
                actor_names=[s.actor_name for s in ordered],
                queue_names=[self.broker.get_actor(s.actor_name).queue_name for s in ordered],
                missed=[s.missed for s in ordered],
                grace_ms=[s.grace for s in ordered],
                first_runs=[s.next_after(now) for s in ordered],
                define=define,
                stale=now - 2 * self.sync_interval * ONE_MS,
            )
            removed = deleted = 0
            if time.monotonic() - self._created >= self.removed_after / 1000:
                removed, deleted = self._store.remove(
                    conn, removed_after=self.removed_after, retention=REMOVED_RETENTION
                )
        if define:
            self._defined = True
        result = SyncResult(
            added=sum(1 for r in rows if r.added),
            changed=sum(1 for r in rows if r.changed),
            revived=sum(1 for r in rows if r.revived and not r.changed),
            removed=removed,
            deleted=deleted,
        )
        for r in rows:
            if r.added or r.changed or r.revived:
                what = "new" if r.added else "rule changed" if r.changed else "declared again"
                self.logger.info(
                    "Schedule %r (%s): first tick %s",
                    r.name,
                    what,
                    format_tick(self.schedules[r.name].next_after(now)),
                )
        if removed:
            self.logger.info("Marked %d schedule(s) that no scheduler declares as removed", removed)
        return result

    def run_once(self) -> PassResult:
        """One pass: enqueue the due ticks of up to ``CLAIM_BATCH`` schedules in one transaction.

        Raises:
          SchemaNotReady: If the tables are missing or older than revision 6.
          ConnectionClosed/ConnectionFailed: If the database cannot be reached.
          Exception: Whatever a middleware's ``before_enqueue`` raises (nothing is enqueued then).
        """
        broker = self.broker
        runtime = broker.runtime
        if not self.schedules:
            return PassResult(0, 0, 0, 0)
        items: list[StoredMessage] = []
        stored: list[StoredMessage] = []
        payloads: list[str] = []
        missed = 0
        with runtime.connection() as conn, conn.transaction():
            self._begin(conn)
            claimed = self._store.claim(conn, rules=self._rules, limit=CLAIM_BATCH)
            if not claimed:
                return PassResult(0, 0, 0, 0)
            advance: dict[str, list[Any]] = {
                "names": [],
                "next_runs": [],
                "last_runs": [],
                "runs": [],
                "missed": [],
            }
            for row in claimed:
                name = row.name
                schedule = self.schedules[name]
                due = schedule.due(row.next_run_at, row.now)
                for tick in due.ticks:
                    message = schedule.message(broker, tick)
                    broker.emit_before("enqueue", message, None)
                    apply_actor_options(broker, message)
                    items.append(StoredMessage.of(message, 0, broker.options.max_message_bytes))
                if due.late:
                    self.logger.warning(
                        "Schedule %r missed %d tick(s) (more than %d ms late: no scheduler ran): %s",
                        name,
                        due.late,
                        schedule.grace,
                        "enqueued the newest once" if schedule.missed == "once" else "skipped them",
                    )
                missed += due.missed
                advance["names"].append(name)
                advance["next_runs"].append(due.next_run_at)
                advance["last_runs"].append(due.ticks[-1] if due.ticks else None)
                advance["runs"].append(len(due.ticks))
                advance["missed"].append(due.missed)
            if items:
                options = broker.options
                statement = enqueue_statement(
                    items, broker.channel, options.notify == "transaction", options.max_fetch_interval
                )
                result = enqueue_result(
                    statement.name, items, runtime.store.enqueue(conn.cursor(), statement)
                )
                stored, payloads = result.stored, result.payloads
            self._store.advance(conn, **advance)
        # Committed: the ticks are enqueued and the schedules advanced, together.
        for item in stored:
            broker.emit_after("enqueue", item.message, None)
        if broker.options.notify == "after_commit" and payloads:
            runtime.flusher.notify_later(payloads)
        duplicates = len(items) - len(stored)
        if duplicates:
            self.logger.warning(
                "%d tick(s) were already enqueued (idempotency key taken): not again", duplicates
            )
        self.stats["enqueued"] += len(stored)
        self.stats["missed"] += missed
        self.stats["duplicates"] += duplicates
        self.stats["passes"] += 1
        return PassResult(len(claimed), len(stored), missed, duplicates)

    def _begin(self, conn: psycopg.Connection[Any]) -> dt.datetime:
        """Start a transaction's work: bound its idle time (see ``periodic_begin``); return ``now()``."""
        return self._store.begin(conn, idle_timeout=self.idle_timeout)

    def next_due_in(self) -> float | None:
        """Milliseconds until the earliest next tick of this scheduler's schedules, or None.

        Negative or zero when one is due now (typically being enqueued by another scheduler).
        """
        with self.broker.runtime.connection() as conn:
            return self._store.next_due_in(conn, rules=self._rules)


class Periodic(Middleware):
    """Opt-in: run a :class:`Scheduler` in every worker process of the broker.

    ``broker.add_middleware(Periodic())``.  Each worker process (``dramatiq
    app --processes N`` starts N) starts one scheduler after it boots and
    stops it before it shuts down; they share the work through the database.
    ``dramatiq-pg-outbox scheduler --app ...`` also reads the ``schedules``
    and the options of this middleware.

    Parameters:
      schedules(Iterable[Schedule]): Schedules besides those of ``@periodic``.  Default none.
      run_in_workers(bool): Start schedulers in worker processes.  Default True;
        False declares the schedules for standalone schedulers only.
      poll_interval(int), sync_interval(int), removed_after(int), idle_timeout(int):
        As for :class:`Scheduler`, in milliseconds.

    Raises:
      TypeError: At worker boot, if the broker is not a PostgresBroker.
      ValueError: At worker boot, for a bad schedule (see :func:`declared_schedules`).
    """

    def __init__(
        self,
        schedules: Iterable[Schedule] = (),
        *,
        run_in_workers: bool = True,
        poll_interval: int = DEFAULT_POLL_INTERVAL,
        sync_interval: int = DEFAULT_SYNC_INTERVAL,
        removed_after: int = DEFAULT_REMOVED_AFTER,
        idle_timeout: int = DEFAULT_IDLE_TIMEOUT,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.schedules = list(schedules)
        self.run_in_workers = run_in_workers
        self.options = {
            "poll_interval": poll_interval,
            "sync_interval": sync_interval,
            "removed_after": removed_after,
            "idle_timeout": idle_timeout,
        }
        #: The running scheduler of each process (by pid: a fork gets its own).
        self._schedulers: dict[int, Scheduler] = {}

    @property
    def running_scheduler(self) -> Scheduler | None:
        """This process's scheduler, from the worker's boot to its shutdown (else None)."""
        return self._schedulers.get(os.getpid())

    def scheduler(self, broker: Broker) -> Scheduler:
        """A new scheduler of this middleware's schedules on ``broker``.

        Raises:
          TypeError: If ``broker`` is not a PostgresBroker.
        """
        if not isinstance(broker, PostgresBroker):
            raise TypeError(f"Periodic needs a PostgresBroker, not {type(broker).__name__}.")
        return Scheduler(broker, self.schedules, **self.options)

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        if not self.run_in_workers:
            return
        scheduler = self.scheduler(broker)
        scheduler.start()
        self._schedulers[os.getpid()] = scheduler
        self.logger.info("Scheduler started with %d schedule(s)", len(scheduler.schedules))

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        scheduler = self._schedulers.pop(os.getpid(), None)
        if scheduler is not None:
            scheduler.stop()
