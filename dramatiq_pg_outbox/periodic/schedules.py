"""Schedules: what a periodic job declares (cron or interval, time zone, missed-tick policy) and its ticks."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from dramatiq import Actor, Message
from dramatiq.errors import ActorNotFound

from ..broker import PostgresBroker

if TYPE_CHECKING:
    pass


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
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
#: Attribute of an actor's function that holds the schedules of ``@periodic``.
_ATTRIBUTE = "_dramatiq_pg_outbox_schedules"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
#: One millisecond: every=, grace= and the intervals are in milliseconds.
ONE_MS = dt.timedelta(milliseconds=1)

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
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.fullmatch(self.name)):
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
            ms = (after - _EPOCH) // ONE_MS
            return _EPOCH + (ms // self.every + 1) * self.every * ONE_MS
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
            ms = (before - _EPOCH) // ONE_MS
            return _EPOCH + ((ms - 1) // self.every) * self.every * ONE_MS
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
        cutoff = now - self.grace * ONE_MS
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
            payload = message.encode()
        except Exception as e:
            raise ValueError(f"The arguments of schedule {schedule.key!r} cannot be encoded: {e}") from e
        limit = broker.options.max_message_bytes
        if limit is not None and len(payload) > limit:
            raise ValueError(
                f"The message of schedule {schedule.key!r} is {len(payload):,} bytes encoded, over the "
                f"broker's max_message_bytes={limit:,}: pass a reference to the data instead."
            )
        by_name[schedule.key] = schedule
    return by_name


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
