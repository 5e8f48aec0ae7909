"""Periodic jobs: cron-like schedules, each tick enqueued exactly once.

Why: "run this every five minutes" with several worker processes on several
hosts usually means either one special process (a single point of failure)
or every process enqueueing the same tick.  Here any number of schedulers run
(one in every worker process, standalone ones, or both) and the database
decides, per tick, which one enqueues it.

Usage::

    import dramatiq
    from dramatiq_pg_outbox.periodic import Periodic, periodic

    @periodic("*/5 * * * *", tz="Europe/Paris")   # above or below @dramatiq.actor
    @dramatiq.actor
    def refresh_rates() -> None: ...

    broker.add_middleware(Periodic())    # a scheduler in every worker process

or, instead of (or beside) the middleware, ``dramatiq-pg-outbox scheduler
--app myapp.tasks`` as a process of its own.  Schedules can also be listed
explicitly: ``Periodic(schedules=[Schedule(refresh_rates, "*/5 * * * *")])``.

How it works
------------
- Table ``<schema>.schedules`` (revision 0006): one row per schedule with its
  rule and ``next_run_at``, the next tick to enqueue (database clock).
- A pass of a scheduler is one transaction: ``periodic_claim`` selects the due
  rows of the schedules it declares with ``FOR UPDATE SKIP LOCKED``; for each,
  the due ticks are computed here (cron rules by cronsim, in the schedule's
  time zone), their messages are written with the broker's own ``enqueue``
  statement on the same connection, and ``periodic_advance`` moves
  ``next_run_at`` past ``now()``; then COMMIT.
- Exactly once: a tick is enqueued in the transaction that moves
  ``next_run_at`` past it, and only there.  The row lock serialises those
  transactions per schedule, and a row advanced by a committed transaction
  fails the ``next_run_at <= now()`` re-check, so successive passes enqueue
  disjoint, adjacent runs of ticks: none twice, none skipped (except by the
  missed policy below).  A scheduler that dies mid-pass (kill -9, lost
  connection) rolls back both its messages and its advance; another scheduler
  takes the tick.  A scheduler frozen mid-pass (its host gone, no FIN) holds
  its rows until the server ends its idle transaction, after ``idle_timeout``
  (10 s).  Each message also carries the idempotency key
  ``periodic:<name>:<tick>`` (UTC, milliseconds), which the messages table
  refuses twice: a second guard, and the tick's name for operators.
- Timing: after a pass a scheduler sleeps until the earliest next tick of its
  schedules (a server-relative figure: no clock conversion), at most
  ``poll_interval``.  All schedulers wake at a tick; one wins the row lock,
  the others skip it and look again shortly.
- Missed ticks: a tick found more than ``grace`` ms late (every scheduler was
  down, or stalled) is a missed tick.  ``missed="once"`` (default) enqueues the
  newest missed tick once, ``"skip"`` enqueues none; never one message per
  missed tick.  Ticks at most ``grace`` late are enqueued one by one (at most
  ``MAX_TICKS_PER_PASS`` per schedule per pass), so a restart or a stall
  loses nothing.
- Deploys: a scheduler starting writes its declarations (``periodic_declare``):
  a new schedule starts at its first tick after now; a changed rule (cron,
  every, tz) starts afresh at its next tick; an unchanged one keeps its
  ``next_run_at`` (missed ticks follow the policy).  During a rolling deploy
  that changed a rule, the processes of each version leave the other's rule
  alone while a process of that version marks it seen; a rule nobody marked
  seen for two ``sync_interval`` is taken over.  Every running scheduler
  marks its schedules seen every ``sync_interval``; a schedule no running
  scheduler declares is not enqueued by anyone, is marked removed after
  ``removed_after`` and deleted ``REMOVED_RETENTION`` later.

Connections: none of its own; a pass borrows one connection of the broker's
pool for one short transaction.

The "misfire grace time" and "coalesce" ideas come from APScheduler; the
River/Oban shape (a loop with a ``run_once`` returning counts) from the
project's maintenance loops.
"""

from __future__ import annotations

from .scheduler import PassResult, Periodic, Scheduler, SyncResult
from .schedules import (
    CLAIM_BATCH,
    DEFAULT_GRACE,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_REMOVED_AFTER,
    DEFAULT_SYNC_INTERVAL,
    KEY_PREFIX,
    MAX_COUNTED_MISSED,
    MAX_TICKS_PER_PASS,
    Due,
    MissedPolicy,
    Schedule,
    declared_schedules,
    format_tick,
    periodic,
    tick_key,
)

__all__ = [
    "CLAIM_BATCH",
    "DEFAULT_GRACE",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_REMOVED_AFTER",
    "DEFAULT_SYNC_INTERVAL",
    "KEY_PREFIX",
    "MAX_COUNTED_MISSED",
    "MAX_TICKS_PER_PASS",
    "Due",
    "MissedPolicy",
    "PassResult",
    "Periodic",
    "Schedule",
    "Scheduler",
    "SyncResult",
    "declared_schedules",
    "format_tick",
    "periodic",
    "tick_key",
]
