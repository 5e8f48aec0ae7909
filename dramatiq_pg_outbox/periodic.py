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

import dataclasses
import datetime as dt
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from dramatiq import Actor, Message
from dramatiq.errors import ActorNotFound
from dramatiq.logging import get_logger
from dramatiq.middleware import Middleware

from ._queries import queries_for_schema
from ._runtime import Service, StoredMessage, enqueue_result, enqueue_statement
from .broker import PostgresBroker

if TYPE_CHECKING:
    from dramatiq import Broker, Worker


#: What happens to ticks more than ``grace`` late: ``"once"`` (the newest is enqueued) or ``"skip"``.
MissedPolicy = Literal["once", "skip"]

#: Default lateness up to which a tick is still enqueued on its own, in milliseconds.
DEFAULT_GRACE = 60_000
#: Default longest sleep of a scheduler between passes, in milliseconds.
DEFAULT_POLL_INTERVAL = 5_000
#: Default period of a scheduler's refresh of its schedules' ``seen_at``, in milliseconds.
DEFAULT_SYNC_INTERVAL = 60_000
#: Default silence after which a schedule no scheduler declares is marked removed, in milliseconds.
DEFAULT_REMOVED_AFTER = 600_000
#: Age of a removed schedule's mark after which its row is deleted, in milliseconds (30 days).
REMOVED_RETENTION = 30 * 86_400_000
#: Most ticks of one schedule enqueued by one pass; the rest go in the next pass, at once.
MAX_TICKS_PER_PASS = 1_000
#: Most missed ticks counted one by one in a pass (beyond, the newest is found directly).
MAX_COUNTED_MISSED = 10_000
#: Schedules claimed per pass (a pass that claims this many is followed by another at once).
CLAIM_BATCH = 100
#: Pause before looking again at a due schedule that another scheduler holds, in milliseconds.
LOCKED_RETRY = 25
#: Default longest time a scheduler's transaction may sit idle before the server ends it, in
#: milliseconds: how long a scheduler whose host vanished mid-pass holds its schedules.
DEFAULT_IDLE_TIMEOUT = 10_000
#: Prefix of the idempotency key of a tick's message: ``periodic:<name>:<tick>``.
KEY_PREFIX = "periodic"

#: Schedule names: letters, digits and ``_ . : -`` (they go into idempotency keys).
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
#: Attribute of an actor's function that holds the schedules of ``@periodic``.
_ATTRIBUTE = "_dramatiq_pg_outbox_schedules"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_MS = dt.timedelta(milliseconds=1)

F = TypeVar("F", bound=Callable[..., Any])


def format_tick(tick: dt.datetime) -> str:
    """A tick as stored in keys and passed to actors: ``2026-11-23T10:05:00.000Z`` (UTC)."""
    return tick.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def tick_key(name: str, tick: dt.datetime) -> str:
    """The idempotency key of the message of one tick: ``periodic:<name>:<tick>``."""
    return f"{KEY_PREFIX}:{name}:{format_tick(tick)}"


@dataclass(frozen=True)
class Due:
    """What one pass does for one schedule (see :meth:`Schedule.due`)."""

    #: Ticks to enqueue, oldest first.
    ticks: list[dt.datetime]
    #: The schedule's next tick after this pass.
    next_run_at: dt.datetime
    #: Ticks that get no message of their own (the missed policy).
    missed: int
    #: Ticks more than ``grace`` late (enqueued once, or skipped, as a group).
    late: int


@dataclass(frozen=True)
class Schedule:
    """One periodic job: an actor, a rule, and the message to send at each tick.

    Exactly one of ``cron`` and ``every`` is given.

    Parameters:
      actor(str|Actor|None): The actor (or its name).  None only inside ``@periodic``,
        which fills it in.
      cron(str): A cron expression, read by cronsim (``pip install
        'dramatiq-pg-outbox[periodic]'``): 5 fields ``minute hour day-of-month month
        day-of-week`` (``*/5 * * * *``, ``0 9 * * MON-FRI``, ``L``, ``#``), or 6 with
        a seconds field first (``*/10 * * * * *``: every 10 seconds).  Evaluated in ``tz``.
      every(int): Instead of ``cron``: a tick every ``every`` milliseconds (>= 1),
        aligned on the Unix epoch (``every=1000``: each whole second, UTC).
      tz(str): IANA time zone of ``cron`` (``Europe/Paris``).  Default ``UTC``.
        Daylight saving time is cronsim's (Debian cron's rules for 5-field
        expressions): a time skipped by the spring change runs right after
        it, a time repeated in autumn runs once; ``*`` hour fields follow real
        time.  ``every`` schedules take no time zone.
      args(tuple): Positional arguments of each message.  Default none.
      kwargs(dict): Keyword arguments of each message.  Default none.
      options(dict): Message options (``max_retries``, ``time_limit``...).  Default none.
      name(str): The schedule's name, unique per schema: letters, digits and
        ``_ . : -``.  Default: the actor's name (give one to each schedule of an
        actor that has several).
      missed(str): ``"once"`` (default): after ticks were missed (more than
        ``grace`` late: every scheduler was down), enqueue the newest missed
        tick once; ``"skip"``: enqueue none of them.  The schedule then goes on
        at its next tick.
      grace(int): How late a tick may be and still be enqueued on its own, in
        milliseconds, >= 0.  Default 60000.
      tick_kwarg(str): If set, each message gets the tick (``format_tick``, e.g.
        ``"2026-11-23T10:05:00.000Z"``) as this keyword argument.  Default None.

    Raises:
      ValueError: For a bad rule, time zone, policy, name or argument.
      ImportError: For a ``cron`` rule without cronsim installed.
    """

    actor: str | Actor[..., Any] | None = None
    cron: str | None = None
    every: int | None = None
    tz: str = "UTC"
    args: tuple[Any, ...] = field(default=(), hash=False)
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    name: str | None = None
    missed: MissedPolicy = "once"
    grace: int = DEFAULT_GRACE
    tick_kwarg: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.actor, Actor):
            object.__setattr__(self, "actor", self.actor.actor_name)
        if self.actor is not None and (not isinstance(self.actor, str) or not self.actor):
            raise ValueError(f"actor must be an actor or an actor name, not {self.actor!r}")
        if (self.cron is None) == (self.every is None):
            raise ValueError(
                'Give a schedule exactly one rule: a cron expression ("*/5 * * * *") or every=<milliseconds>.'
            )
        if self.every is not None:
            if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
                raise ValueError(f"every must be a whole number of milliseconds >= 1, not {self.every!r}")
            if self.tz != "UTC":
                raise ValueError(
                    f"tz={self.tz!r} does not apply to every= schedules (their ticks are aligned on "
                    "the Unix epoch); use a cron expression for wall-clock times."
                )
        if self.cron is not None:
            if not isinstance(self.cron, str):
                raise ValueError(f"cron must be a string, not {self.cron!r}")
            _check_cron(self.cron)
        if not isinstance(self.tz, str) or not self.tz:
            raise ValueError(f"tz must be an IANA time zone name such as 'Europe/Paris', not {self.tz!r}")
        try:
            ZoneInfo(self.tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"Unknown time zone {self.tz!r}: use an IANA name such as 'Europe/Paris' or 'UTC' "
                "(where the system has no time zone database, pip install tzdata)."
            ) from None
        if self.missed not in ("once", "skip"):
            raise ValueError(f"missed must be 'once' or 'skip', not {self.missed!r}")
        if not isinstance(self.grace, int) or isinstance(self.grace, bool) or self.grace < 0:
            raise ValueError(f"grace must be a whole number of milliseconds >= 0, not {self.grace!r}")
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.match(self.name)):
            raise ValueError(f"Invalid schedule name {self.name!r}: use 1 to 200 letters, digits and _ . : -")
        if not isinstance(self.args, tuple):
            object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        object.__setattr__(self, "options", dict(self.options))
        if self.tick_kwarg is not None:
            if not isinstance(self.tick_kwarg, str) or not self.tick_kwarg.isidentifier():
                raise ValueError(f"tick_kwarg must be an argument name, not {self.tick_kwarg!r}")
            if self.tick_kwarg in self.kwargs:
                raise ValueError(f"tick_kwarg {self.tick_kwarg!r} is also in kwargs")
        if "idempotency_key" in self.options:
            raise ValueError("options may not set idempotency_key: each tick's message has its own")

    @property
    def actor_name(self) -> str:
        """The actor's name.

        Raises:
          ValueError: If the schedule has no actor yet.
        """
        if not isinstance(self.actor, str):
            raise ValueError("This schedule has no actor: pass actor=, or use @periodic on an actor.")
        return self.actor

    @property
    def key(self) -> str:
        """The schedule's name: ``name``, or the actor's name."""
        return self.name or self.actor_name

    @property
    def rule(self) -> str:
        """The rule as shown to operators: the cron expression or ``every 1000 ms``."""
        return self.cron if self.cron is not None else f"every {self.every} ms"

    def next_after(self, after: dt.datetime) -> dt.datetime:
        """The first tick strictly after ``after`` (an aware datetime), in UTC."""
        if self.every is not None:
            ms = (after - _EPOCH) // _MS
            return _EPOCH + (ms // self.every + 1) * self.every * _MS
        assert self.cron is not None
        for tick in _cron_ticks(self.cron, after.astimezone(ZoneInfo(self.tz))):
            # cronsim evaluates 5-field expressions with fixed hours on naive local
            # time (Debian cron's DST rules); from inside a repeated autumn hour
            # it can return a time before `after`: skip those.
            if tick > after:
                return tick.astimezone(dt.timezone.utc)
        raise AssertionError("unreachable: cron iterators do not end")

    def previous_before(self, before: dt.datetime) -> dt.datetime:
        """The last tick strictly before ``before`` (an aware datetime), in UTC."""
        if self.every is not None:
            ms = (before - _EPOCH) // _MS
            return _EPOCH + ((ms - 1) // self.every) * self.every * _MS
        assert self.cron is not None
        for tick in _cron_ticks(self.cron, before.astimezone(ZoneInfo(self.tz)), reverse=True):
            if tick < before:
                return tick.astimezone(dt.timezone.utc)
        raise AssertionError("unreachable: cron iterators do not end")

    def due(self, next_run_at: dt.datetime, now: dt.datetime) -> Due:
        """What a pass at ``now`` does for this schedule, whose next tick is ``next_run_at``.

        Ticks in ``[next_run_at, now]`` are due.  Those at most ``grace`` ms
        late are enqueued one by one (``MAX_TICKS_PER_PASS`` at most; the rest
        stay due); older ones were missed: with ``missed="once"`` the newest
        of them is enqueued, with ``"skip"`` none.

        Parameters:
          next_run_at(datetime): The schedule's stored next tick (aware).
          now(datetime): The database's ``now()`` (aware).

        Returns:
          Due: The ticks to enqueue, the next tick, and the count of missed
          ticks that got no message (counted up to ``MAX_COUNTED_MISSED``).
        """
        cutoff = now - self.grace * _MS
        tick = next_run_at
        newest_missed: dt.datetime | None = None
        missed = 0
        while tick < cutoff:
            newest_missed = tick
            missed += 1
            if missed >= MAX_COUNTED_MISSED:
                newest_missed = max(newest_missed, self.previous_before(cutoff))
                tick = self.next_after(newest_missed)
                break
            tick = self.next_after(tick)
        ticks: list[dt.datetime] = []
        while tick <= now and len(ticks) < MAX_TICKS_PER_PASS:
            ticks.append(tick)
            tick = self.next_after(tick)
        late = missed
        if newest_missed is not None and self.missed == "once":
            ticks.insert(0, newest_missed)
            missed -= 1
        return Due(ticks, tick, missed, late)

    def message(self, broker: PostgresBroker, tick: dt.datetime) -> Message[Any]:
        """The message of one tick, with its idempotency key.

        Raises:
          ActorNotFound: If ``broker`` does not declare the actor.
        """
        actor = broker.get_actor(self.actor_name)
        kwargs = dict(self.kwargs)
        if self.tick_kwarg is not None:
            kwargs[self.tick_kwarg] = format_tick(tick)
        options = {**self.options, "idempotency_key": tick_key(self.key, tick)}
        return actor.message_with_options(args=self.args, kwargs=kwargs, **options)


def periodic(
    cron: str | None = None,
    *,
    every: int | None = None,
    tz: str = "UTC",
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    name: str | None = None,
    missed: MissedPolicy = "once",
    grace: int = DEFAULT_GRACE,
    tick_kwarg: str | None = None,
) -> Callable[[F], F]:
    """Declare a schedule on an actor: ``@periodic("*/5 * * * *", tz="Europe/Paris")``.

    Put it above or below ``@dramatiq.actor``: it records the schedule on the
    actor's function, where every :class:`Scheduler` of the actor's broker
    finds it.  Stack several for several schedules (give each a ``name``).
    The parameters are those of :class:`Schedule`, checked here.

    Raises:
      ValueError: For a bad rule, time zone, policy, name or argument.
    """
    template = Schedule(
        cron=cron,
        every=every,
        tz=tz,
        args=tuple(args),
        kwargs=dict(kwargs or {}),
        options=dict(options or {}),
        name=name,
        missed=missed,
        grace=grace,
        tick_kwarg=tick_kwarg,
    )

    def decorate(target: F) -> F:
        fn = target.fn if isinstance(target, Actor) else target
        schedules = list(getattr(fn, _ATTRIBUTE, ()))
        schedules.append(template)
        setattr(fn, _ATTRIBUTE, schedules)
        return target

    return decorate


def declared_schedules(broker: PostgresBroker, schedules: Iterable[Schedule] = ()) -> dict[str, Schedule]:
    """The schedules of ``@periodic`` on the broker's actors, plus ``schedules``, by name.

    Raises:
      ValueError: If a schedule names an actor the broker does not declare,
        two schedules share a name, or a schedule's arguments cannot be encoded.
    """
    found: list[Schedule] = []
    for actor_name in sorted(broker.get_declared_actors()):
        actor = broker.get_actor(actor_name)
        for template in getattr(actor.fn, _ATTRIBUTE, ()):
            found.append(dataclasses.replace(template, actor=actor_name))
    found.extend(schedules)
    by_name: dict[str, Schedule] = {}
    for schedule in found:
        if not isinstance(schedule, Schedule):
            raise ValueError(f"Expected Schedule objects, got {schedule!r}")
        try:
            message = schedule.message(broker, _EPOCH)
        except ActorNotFound:
            raise ValueError(
                f"Schedule {schedule.key!r} names actor {schedule.actor_name!r}, which {broker!r} does "
                "not declare: import the module that defines it before the scheduler starts."
            ) from None
        if schedule.key in by_name:
            raise ValueError(
                f"Two schedules are named {schedule.key!r}: give each schedule of an actor its own name=."
            )
        try:
            message.encode()
        except Exception as e:
            raise ValueError(f"The arguments of schedule {schedule.key!r} cannot be encoded: {e}") from e
        by_name[schedule.key] = schedule
    return by_name


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
        self._rules: dict[str, Any] = {
            "names": [s.key for s in ordered],
            "crons": [s.cron for s in ordered],
            "every_ms": [s.every for s in ordered],
            "tzs": [s.tz for s in ordered],
        }
        self._queries = queries_for_schema(broker.schema)
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
            rows = conn.execute(
                self._queries["periodic_declare"],
                {
                    **self._rules,
                    "actor_names": [s.actor_name for s in ordered],
                    "queue_names": [self.broker.get_actor(s.actor_name).queue_name for s in ordered],
                    "missed": [s.missed for s in ordered],
                    "grace_ms": [s.grace for s in ordered],
                    "first_runs": [s.next_after(now) for s in ordered],
                    "define": define,
                    "stale": now - 2 * self.sync_interval * _MS,
                },
            ).fetchall()
            removed = deleted = 0
            if time.monotonic() - self._created >= self.removed_after / 1000:
                counts = conn.execute(
                    self._queries["periodic_remove"],
                    {"removed_after": self.removed_after, "retention": REMOVED_RETENTION},
                ).fetchone()
                assert counts is not None
                removed, deleted = int(counts[0]), int(counts[1])
        if define:
            self._defined = True
        result = SyncResult(
            added=sum(1 for r in rows if r[1]),
            changed=sum(1 for r in rows if r[2]),
            revived=sum(1 for r in rows if r[3] and not r[2]),
            removed=removed,
            deleted=deleted,
        )
        for name, added, changed, revived in rows:
            if added or changed or revived:
                what = "new" if added else "rule changed" if changed else "declared again"
                self.logger.info(
                    "Schedule %r (%s): first tick %s",
                    name,
                    what,
                    format_tick(self.schedules[name].next_after(now)),
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
            claimed = conn.execute(
                self._queries["periodic_claim"], {**self._rules, "limit": CLAIM_BATCH}
            ).fetchall()
            if not claimed:
                return PassResult(0, 0, 0, 0)
            advance: dict[str, list[Any]] = {
                "names": [],
                "next_runs": [],
                "last_runs": [],
                "runs": [],
                "missed": [],
            }
            for name, next_run_at, now in claimed:
                schedule = self.schedules[name]
                due = schedule.due(next_run_at, now)
                for tick in due.ticks:
                    message = schedule.message(broker, tick)
                    broker.emit_before("enqueue", message, None)
                    items.append(StoredMessage.of(message))
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
                query, params = enqueue_statement(
                    items, broker.channel, options.notify == "transaction", options.max_fetch_interval
                )
                result = enqueue_result(query, items, conn.execute(self._queries[query], params).fetchall())
                stored, payloads = result.stored, result.payloads
            conn.execute(self._queries["periodic_advance"], advance)
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
        row = conn.execute(self._queries["periodic_begin"], {"idle_timeout": self.idle_timeout}).fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    def next_due_in(self) -> float | None:
        """Milliseconds until the earliest next tick of this scheduler's schedules, or None.

        Negative or zero when one is due now (typically being enqueued by another scheduler).
        """
        rows = self.broker.runtime.execute("periodic_next_due", self._rules)
        value = rows[0][0] if rows else None
        return None if value is None else float(value)


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


# -- cronsim, imported on first use (the [periodic] extra) --------------------------


def _cron_ticks(expr: str, start: dt.datetime, reverse: bool = False) -> Iterator[dt.datetime]:
    CronSim = _cronsim()[0]
    return iter(CronSim(expr, start, reverse=reverse))


def _check_cron(expr: str) -> None:
    CronSim, CronSimError = _cronsim()
    try:
        CronSim(expr, dt.datetime.now(dt.timezone.utc))
    except CronSimError as e:
        raise ValueError(
            f"Invalid cron expression {expr!r}: {e}. Use 5 fields (minute hour day-of-month month "
            "day-of-week), or 6 with a seconds field first."
        ) from None


def _cronsim() -> tuple[Any, type[Exception]]:
    try:
        from cronsim import CronSim, CronSimError
    except ImportError:
        raise ImportError("cron schedules need cronsim: pip install 'dramatiq-pg-outbox[periodic]'") from None
    return CronSim, CronSimError
