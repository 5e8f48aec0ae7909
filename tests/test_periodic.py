"""Periodic jobs: ticks enqueued exactly once by any number of schedulers.

Real parts: a real PostgreSQL (each test in a schema of its own, dropped at
the end), real ``dramatiq-pg-outbox scheduler`` processes, a real Dramatiq
Worker; the time-zone arithmetic is checked at unit level against cronsim.
"""

from __future__ import annotations

import datetime as dt
import inspect
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from alembic.script import ScriptDirectory
from dramatiq.middleware import Middleware

from dramatiq_pg_outbox import PostgresBroker, downgrade, upgrade
from dramatiq_pg_outbox.cli import main
from dramatiq_pg_outbox.migrations import script_location
from dramatiq_pg_outbox.periodic import (
    MAX_COUNTED_MISSED,
    MAX_TICKS_PER_PASS,
    Periodic,
    Schedule,
    Scheduler,
    declared_schedules,
    format_tick,
    periodic,
    tick_key,
)
from examples.periodic_spread import spread
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent
UTC = dt.timezone.utc


def at(text: str) -> dt.datetime:
    """An aware datetime from ISO text (``2026-03-29T01:00:00+00:00``)."""
    return dt.datetime.fromisoformat(text)


@pytest.fixture
def schema(database_url: str) -> Iterator[str]:
    """A fresh schema at head for this test only, dropped at the end."""
    name = f"periodic_{uuid.uuid4().hex[:10]}"
    upgrade(database_url, schema=name)
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture
def brokers(database_url: str, schema: str) -> Iterator[Callable[..., PostgresBroker]]:
    """Factory of PostgresBrokers on this test's schema; closed at the end."""
    made: list[PostgresBroker] = []

    def make(**options: Any) -> PostgresBroker:
        broker = PostgresBroker(url=database_url, schema=schema, **options)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.close()


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


def db_now(db: psycopg.Connection[Any]) -> dt.datetime:
    row = db.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def stored_keys(db: psycopg.Connection[Any], schema: str) -> list[str]:
    rows = db.execute(
        f"SELECT idempotency_key FROM {schema}.messages UNION ALL "
        f"SELECT idempotency_key FROM {schema}.history ORDER BY 1"
    ).fetchall()
    return [r[0] for r in rows]


def schedule_row(db: psycopg.Connection[Any], schema: str, name: str) -> dict[str, Any]:
    cur = db.execute(f"SELECT * FROM {schema}.schedules WHERE name = %s", (name,))
    row = cur.fetchone()
    assert row is not None, f"no schedule {name!r}"
    assert cur.description is not None
    return {column.name: value for column, value in zip(cur.description, row, strict=True)}


def make_due(db: psycopg.Connection[Any], schema: str, name: str, tick: dt.datetime) -> None:
    """Set a schedule's next tick, as if no scheduler had run since."""
    db.execute(f"UPDATE {schema}.schedules SET next_run_at = %s WHERE name = %s", (tick, name))


def last_tick_clear_of_the_next(
    db: psycopg.Connection[Any], schedule: Schedule, margin: float = 20
) -> dt.datetime:
    """The schedule's last tick, at a moment at least ``margin`` seconds before its next one.

    A test that makes the last tick due and counts what one pass enqueues would see two
    ticks if the next one fell due in between (a minute boundary while the machine is
    loaded); so when the next tick is near, wait until it has passed.
    """
    now = db_now(db)
    wait = (schedule.next_after(now) - now).total_seconds()
    if wait < margin:
        time.sleep(wait + 0.05)
        now = db_now(db)
    return schedule.previous_before(now)


# -- rules and time zones (unit level, with cronsim) ----------------------------------------


def test_a_paris_cron_follows_daylight_saving_time() -> None:
    # Given schedules in Europe/Paris (CET +1, CEST +2 from 2026-03-29 to 2026-10-25)
    nine = Schedule("a", "0 9 * * *", tz="Europe/Paris")
    half_past_two = Schedule("a", "30 2 * * *", tz="Europe/Paris")
    half_hourly = Schedule("a", "*/30 * * * *", tz="Europe/Paris")
    # Then 09:00 in Paris is 08:00 UTC in winter and 07:00 UTC in summer
    assert nine.next_after(at("2026-01-15T12:00:00+00:00")) == at("2026-01-16T08:00:00+00:00")
    assert nine.next_after(at("2026-07-15T12:00:00+00:00")) == at("2026-07-16T07:00:00+00:00")
    # And 02:30 does not exist on 2026-03-29: the job runs right after the jump, at 03:00 CEST
    assert half_past_two.next_after(at("2026-03-28T12:00:00+00:00")) == at("2026-03-29T01:00:00+00:00")
    # And 02:30 happens twice on 2026-10-25: the job runs once, at the first one (CEST)
    first = half_past_two.next_after(at("2026-10-24T12:00:00+00:00"))
    assert first == at("2026-10-25T00:30:00+00:00")
    assert half_past_two.next_after(first) == at("2026-10-26T01:30:00+00:00")
    # ... also when computed from inside the repeated hour (cronsim would answer the past)
    assert half_past_two.next_after(at("2026-10-25T01:15:00+00:00")) == at("2026-10-26T01:30:00+00:00")
    # And a wildcard hour follows real time through both 02:xx hours
    ticks = [at("2026-10-24T23:10:00+00:00")]
    for _ in range(5):
        ticks.append(half_hourly.next_after(ticks[-1]))
    assert [t.strftime("%H:%M") for t in ticks[1:]] == ["23:30", "00:00", "00:30", "01:00", "01:30"]
    # And previous_before is the mirror of next_after
    assert nine.previous_before(at("2026-07-16T07:00:00+00:00")) == at("2026-07-15T07:00:00+00:00")


def test_every_and_six_field_crons_tick_below_the_minute() -> None:
    # Given an interval in milliseconds and a cron with a seconds field
    every = Schedule("a", every=1_500)
    seconds = Schedule("a", "*/10 * * * * *")
    start = at("2026-11-23T10:00:01.200+00:00")
    # Then interval ticks are aligned on the Unix epoch, whatever the start
    assert every.next_after(start) == at("2026-11-23T10:00:01.500+00:00")
    assert every.next_after(at("2026-11-23T10:00:01.500+00:00")) == at("2026-11-23T10:00:03+00:00")
    assert every.previous_before(at("2026-11-23T10:00:01.500+00:00")) == at("2026-11-23T10:00:00+00:00")
    # And the six-field cron ticks every 10 seconds
    assert seconds.next_after(start) == at("2026-11-23T10:00:10+00:00")
    assert format_tick(at("2026-11-23T11:00:10+01:00")) == "2026-11-23T10:00:10.000Z"


def test_late_ticks_within_grace_run_one_by_one_and_older_ones_follow_the_missed_policy() -> None:
    # Given a 1 s schedule whose next tick is 10 s old, with a grace of 3 s
    now = at("2026-11-23T10:00:10.400+00:00")
    start = at("2026-11-23T10:00:00+00:00")
    once = Schedule("a", every=1_000, grace=3_000)
    skip = Schedule("a", every=1_000, grace=3_000, missed="skip")
    # When a pass runs at `now`
    due_once, due_skip = once.due(start, now), skip.due(start, now)
    on_time = [at(f"2026-11-23T10:00:{s:02d}+00:00") for s in (8, 9, 10)]
    # Then ticks at most 3 s late are enqueued one by one; of the 8 older ones
    # "once" enqueues the newest, "skip" none; both go on at the next tick
    assert due_once.ticks == [at("2026-11-23T10:00:07+00:00"), *on_time]
    assert (due_once.missed, due_once.late) == (7, 8)
    assert due_skip.ticks == on_time
    assert (due_skip.missed, due_skip.late) == (8, 8)
    assert due_once.next_run_at == due_skip.next_run_at == at("2026-11-23T10:00:11+00:00")
    # And a schedule on time enqueues exactly its due tick
    assert once.due(at("2026-11-23T10:00:10+00:00"), now).ticks == [at("2026-11-23T10:00:10+00:00")]
    # And a pass enqueues at most MAX_TICKS_PER_PASS ticks; the rest stay due for the next pass
    long_grace = Schedule("a", every=10, grace=60_000)
    capped = long_grace.due(start, start + dt.timedelta(seconds=30))
    assert len(capped.ticks) == MAX_TICKS_PER_PASS
    assert capped.next_run_at == start + dt.timedelta(milliseconds=10 * MAX_TICKS_PER_PASS)


def test_a_long_outage_of_a_one_second_schedule_is_one_message_not_a_burst() -> None:
    # Given a 1 s schedule whose schedulers were all down for two days
    schedule = Schedule("a", "* * * * * *", grace=0)
    start = at("2026-11-21T10:00:00+00:00")
    now = at("2026-11-23T10:00:00.500+00:00")
    # When a pass runs
    began = time.monotonic()
    due = schedule.due(start, now)
    # Then one message, for the newest missed tick, and the schedule goes on
    assert due.ticks == [at("2026-11-23T10:00:00+00:00")]
    assert due.next_run_at == at("2026-11-23T10:00:01+00:00")
    # And the count stops at MAX_COUNTED_MISSED instead of walking 172,800 ticks
    assert due.late == MAX_COUNTED_MISSED
    print(f"\ntwo days of missed 1 s ticks handled in {time.monotonic() - began:.3f}s")


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({}, "exactly one rule"),
        ({"cron": "* * * * *", "every": 1000}, "exactly one rule"),
        ({"cron": "61 * * * *"}, "Invalid cron expression '61 \\* \\* \\* \\*': Bad minute"),
        ({"cron": "* * * *"}, "Wrong number of fields"),
        ({"cron": "* * * * *", "tz": "Europe/Parsi"}, "Unknown time zone 'Europe/Parsi'"),
        ({"every": 0}, "every must be a whole number of milliseconds >= 1"),
        ({"every": 1.5}, "every must be a whole number"),
        ({"every": 1000, "tz": "Europe/Paris"}, "does not apply to every= schedules"),
        ({"every": 1000, "missed": "all"}, "missed must be 'once' or 'skip'"),
        ({"every": 1000, "grace": -1}, "grace must be"),
        ({"every": 1000, "name": "has space"}, "Invalid schedule name"),
        ({"every": 1000, "name": "nightly\n"}, "Invalid schedule name"),
        ({"every": 1000, "tick_kwarg": "tick", "kwargs": {"tick": 1}}, "also in kwargs"),
        ({"every": 1000, "options": {"idempotency_key": "k"}}, "may not set idempotency_key"),
    ],
)
def test_bad_declarations_are_refused_when_declared(arguments: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        periodic(**arguments)


# -- declaring ----------------------------------------------------------------------------------


def test_periodic_stacks_with_dramatiq_actor_in_either_order(brokers: Callable[..., PostgresBroker]) -> None:
    broker = brokers()

    # Given @periodic above and below @dramatiq.actor, and an explicit Schedule
    @periodic("0 7 * * 1-5", tz="Europe/Paris", kwargs={"kind": "daily"}, tick_kwarg="tick")
    @dramatiq.actor(broker=broker)
    def report(kind: str, tick: str) -> None: ...

    @dramatiq.actor(broker=broker, actor_name="beat_actor")
    @periodic(every=1_000, args=(1, 2))
    @periodic(every=60_000, name="beat_slow", missed="skip")
    def beat(x: int = 0, y: int = 0) -> None: ...

    explicit = Schedule(report, "0 12 * * *", name="report_noon")
    # When the schedules are collected
    schedules = declared_schedules(broker, [explicit])
    # Then each has its actor, rule and arguments
    assert sorted(schedules) == ["beat_actor", "beat_slow", "report", "report_noon"]
    assert schedules["beat_actor"].args == (1, 2) and schedules["beat_actor"].every == 1_000
    assert schedules["beat_slow"].actor_name == "beat_actor" and schedules["beat_slow"].missed == "skip"
    assert schedules["report"].tz == "Europe/Paris"
    message = schedules["report"].message(broker, at("2026-11-23T06:00:00+00:00"))
    assert message.kwargs == {"kind": "daily", "tick": "2026-11-23T06:00:00.000Z"}
    assert message.options["idempotency_key"] == "periodic:report:2026-11-23T06:00:00.000Z"
    # And the decorated objects are unchanged
    assert isinstance(report, dramatiq.Actor) and isinstance(beat, dramatiq.Actor)


def test_a_schedule_of_an_unknown_actor_or_a_duplicate_name_is_refused(
    brokers: Callable[..., PostgresBroker],
) -> None:
    broker = brokers()

    @periodic(every=1_000)
    @dramatiq.actor(broker=broker)
    def beat() -> None: ...

    with pytest.raises(ValueError, match=r"names actor 'elsewhere', which .* does not declare"):
        Scheduler(broker, [Schedule("elsewhere", every=1_000)])
    with pytest.raises(ValueError, match="Two schedules are named 'beat'"):
        Scheduler(broker, [Schedule(beat, every=5_000)])
    with pytest.raises(ValueError, match="arguments of schedule 'unencodable' cannot be encoded"):
        Scheduler(broker, [Schedule(beat, every=5_000, name="unencodable", args=(object(),))])
    with pytest.raises(ValueError, match="removed_after must be"):
        Scheduler(broker, sync_interval=1_000, removed_after=1_500)


# -- one scheduler against the database ------------------------------------------------------------


def test_a_due_tick_is_enqueued_once_with_its_arguments_and_key(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str
) -> None:
    broker = brokers()

    @periodic("* * * * *", args=(42,), name="minutely")
    @dramatiq.actor(broker=broker)
    def job(x: int) -> None: ...

    # Given a scheduler whose new schedule starts at its next tick, not now
    scheduler = Scheduler(broker)
    assert scheduler.sync().added == 1
    assert scheduler.run_once().enqueued == 0
    row = schedule_row(db, schema, "minutely")
    assert row["next_run_at"] == scheduler.schedules["minutely"].next_after(row["created_at"])
    # When that tick is due
    tick = last_tick_clear_of_the_next(db, scheduler.schedules["minutely"])
    make_due(db, schema, "minutely", tick)
    first, second = scheduler.run_once(), scheduler.run_once()
    # Then one pass enqueues it, the next finds nothing due
    assert (first.claimed, first.enqueued, second.claimed) == (1, 1, 0)
    payload = db.execute(f"SELECT payload FROM {schema}.messages").fetchone()
    assert payload is not None
    message = dramatiq.Message.decode(bytes(payload[0]))
    assert (message.actor_name, message.args) == ("job", (42,))
    assert stored_keys(db, schema) == [tick_key("minutely", tick)]
    row = schedule_row(db, schema, "minutely")
    assert (row["last_run_at"], row["runs"], row["missed_ticks"]) == (tick, 1, 0)
    assert row["next_run_at"] == tick + dt.timedelta(minutes=1)


def test_a_pass_that_fails_after_its_insert_enqueues_nothing_and_leaves_the_tick_due(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str
) -> None:
    broker = brokers()

    @periodic("* * * * *")
    @dramatiq.actor(broker=broker)
    def job() -> None: ...

    scheduler = Scheduler(broker)
    scheduler.sync()
    tick = last_tick_clear_of_the_next(db, scheduler.schedules["job"])
    make_due(db, schema, "job", tick)
    # Given a trigger that makes the advance of next_run_at fail: after the
    # pass has inserted its message, in the same transaction
    db.execute(
        f"""CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN RAISE EXCEPTION 'advance refused by the test'; END $$;
            CREATE TRIGGER refuse BEFORE UPDATE ON {schema}.schedules
            FOR EACH ROW WHEN (NEW.runs > OLD.runs) EXECUTE FUNCTION {schema}.refuse()"""
    )
    # When a pass runs
    with pytest.raises(psycopg.errors.RaiseException, match="advance refused"):
        scheduler.run_once()
    # Then neither the message nor the advance happened
    assert stored_keys(db, schema) == []
    assert schedule_row(db, schema, "job")["next_run_at"] == tick
    # And once the cause is gone, the next pass enqueues the tick, once
    db.execute(f"DROP TRIGGER refuse ON {schema}.schedules")
    assert scheduler.run_once().enqueued == 1
    assert stored_keys(db, schema) == [tick_key("job", tick)]


def test_missed_ticks_run_once_on_recovery_by_default_or_are_skipped(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str
) -> None:
    broker = brokers()

    @periodic("0 * * * *", name="hourly_once", grace=0)
    @periodic("0 * * * *", name="hourly_skip", grace=0, missed="skip")
    @dramatiq.actor(broker=broker)
    def job() -> None: ...

    scheduler = Scheduler(broker)
    scheduler.sync()
    # Given every scheduler down for more than three hours: four hourly ticks missed
    hour = scheduler.schedules["hourly_once"].previous_before(db_now(db))
    for name in ("hourly_once", "hourly_skip"):
        make_due(db, schema, name, hour - dt.timedelta(hours=3))
    # When a scheduler comes back (its restart keeps next_run_at) and runs a pass
    restarted = Scheduler(broker)
    assert restarted.sync().changed == 0
    result = restarted.run_once()
    # Then "once" enqueues the newest missed tick once and "skip" none: never a burst
    assert (result.claimed, result.enqueued, result.missed) == (2, 1, 3 + 4)
    assert stored_keys(db, schema) == [tick_key("hourly_once", hour)]
    once, skip = schedule_row(db, schema, "hourly_once"), schedule_row(db, schema, "hourly_skip")
    assert (once["runs"], once["missed_ticks"], once["last_run_at"]) == (1, 3, hour)
    assert (skip["runs"], skip["missed_ticks"], skip["last_run_at"]) == (0, 4, None)
    # And both go on at their next tick
    assert once["next_run_at"] == skip["next_run_at"] == hour + dt.timedelta(hours=1)


def test_schedules_added_changed_or_removed_between_deploys(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str
) -> None:
    broker = brokers()
    a, b, c = (dramatiq.actor(lambda: None, broker=broker, actor_name=n) for n in ("a", "b", "c"))
    # (grace 0: a tick found late counts as missed, so each due schedule gives exactly one
    # message per pass, even if its next tick falls due while the test runs)
    fast = {"sync_interval": 100, "removed_after": 300}
    # Given deploy 1 with A (every second) and B (hourly at :00)
    v1 = Scheduler(
        broker,
        [Schedule(a, every=1_000, name="A", grace=0), Schedule(b, "0 * * * *", name="B", grace=0)],
        **fast,
    )
    v1.sync()
    # When deploy 2 starts with B moved to :30, a new C every 5 minutes, and no A
    v2_schedules = [
        Schedule(b, "30 * * * *", name="B", grace=0),
        Schedule(c, "*/5 * * * *", name="C", grace=0),
    ]
    # (deploy 2 takes a schedule over once its row is older than two of its sync intervals:
    # 2 s here, so that a slow machine between two of the steps below cannot look like a
    # process that is gone; 200 ms did, once, in CI)
    v2 = Scheduler(broker, v2_schedules, sync_interval=1_000, removed_after=2_000)
    result = v2.sync()
    now = db_now(db)
    # Then B's next run is recomputed from its new rule and C starts at its next tick
    assert (result.added, result.changed) == (1, 1)
    assert schedule_row(db, schema, "B")["next_run_at"] == v2.schedules["B"].next_after(now)
    assert schedule_row(db, schema, "C")["next_run_at"] == v2.schedules["C"].next_after(now)
    assert v2.run_once().enqueued == 0
    # And during the rollout a process of deploy 1 still enqueues A, but leaves the new B alone
    for name, scheduler in (("A", v1), ("B", v2), ("C", v2)):
        make_due(db, schema, name, scheduler.schedules[name].previous_before(now))
    old_pass = v1.run_once()
    assert (old_pass.claimed, old_pass.enqueued) == (1, 1)
    assert v2.run_once().enqueued == 2
    assert sorted(key.split(":")[1] for key in stored_keys(db, schema)) == ["A", "B", "C"]
    # And once no running scheduler declares A for removed_after, it is marked removed
    wait_for(lambda: v2.sync(define=False).removed == 1, 10, "A marked removed")
    assert schedule_row(db, schema, "A")["removed_at"] is not None
    # (not enqueued even by a process that still declares it, until it declares it again)
    make_due(db, schema, "A", v1.schedules["A"].previous_before(db_now(db)))
    assert v1.run_once().claimed == 0
    # And a later deploy that declares A again starts it at its next tick (no catch-up)
    v3 = Scheduler(broker, [Schedule(a, every=1_000, name="A", grace=0)], **fast)
    assert v3.sync().revived == 1
    row = schedule_row(db, schema, "A")
    assert row["removed_at"] is None
    assert row["next_run_at"] == v3.schedules["A"].next_after(row["seen_at"])
    # And if a process of deploy 1 restarts during the rollout, it writes its rule of B back;
    # deploy 2 leaves it alone while that process refreshes it, and takes B over once it is gone
    Scheduler(broker, [Schedule(b, "0 * * * *", name="B", grace=0)], **fast).sync()
    assert v2.sync(define=False).changed == 0 and schedule_row(db, schema, "B")["cron"] == "0 * * * *"
    wait_for(lambda: v2.sync(define=False).changed == 1, 10, "B taken over by deploy 2")
    row = schedule_row(db, schema, "B")
    assert row["cron"] == "30 * * * *" and row["next_run_at"] == v2.schedules["B"].next_after(row["seen_at"])


def test_a_scheduler_frozen_inside_a_pass_gives_its_tick_up_after_idle_timeout(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str
) -> None:
    broker = brokers()
    entered, release = threading.Event(), threading.Event()

    class Freeze(Middleware):
        def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            if threading.current_thread().name == "frozen":
                entered.set()
                release.wait(30)

    broker.add_middleware(Freeze())

    @periodic("* * * * *")
    @dramatiq.actor(broker=broker)
    def job() -> None: ...

    frozen, healthy = Scheduler(broker, idle_timeout=500), Scheduler(broker, idle_timeout=500)
    frozen.sync()
    tick = last_tick_clear_of_the_next(db, frozen.schedules["job"], margin=30)
    make_due(db, schema, "job", tick)
    # Given a scheduler frozen inside its pass, holding the schedule's row lock
    # (as a scheduler whose host vanished: its connection stays open)
    errors: list[Exception] = []

    def run() -> None:
        try:
            frozen.run_once()
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=run, name="frozen")
    thread.start()
    try:
        assert entered.wait(10)
        # When another scheduler runs passes: nothing at first (the row is locked)
        assert healthy.run_once().claimed == 0
        # Then, once the server ended the idle transaction, it enqueues the tick
        wait_for(lambda: healthy.run_once().enqueued == 1, 10, "the tick taken over")
    finally:
        release.set()
        thread.join(10)
    # And the frozen scheduler, woken up, enqueues nothing: its transaction is gone
    assert len(errors) == 1
    assert stored_keys(db, schema) == [tick_key("job", tick)]
    assert schedule_row(db, schema, "job")["runs"] == 1


def test_the_periodic_middleware_runs_a_scheduler_in_the_worker(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str
) -> None:
    broker = brokers(max_fetch_interval=100)
    middleware = Periodic(poll_interval=200)
    broker.add_middleware(middleware)
    calls: list[int] = []

    # Given an actor on a 300 ms schedule and a real Dramatiq worker
    @periodic(every=300, args=(7,))
    @dramatiq.actor(broker=broker)
    def beat(x: int) -> None:
        calls.append(x)

    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        # When it runs for a few ticks
        wait_for(lambda: len(calls) >= 3, 30, "three runs of the periodic actor")
        scheduler = middleware.running_scheduler
        assert scheduler is not None and scheduler.running
    finally:
        worker.stop()
    # Then the actor ran with its arguments, and the scheduler stopped with the worker
    assert set(calls) == {7}
    assert middleware.running_scheduler is None
    assert scheduler.started and not scheduler.running
    assert schedule_row(db, schema, "beat")["runs"] >= 3


# -- three scheduler processes -------------------------------------------------------------------


def start_scheduler(database_url: str, schema: str, hold_ms: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DPO_TEST_URL": database_url, "DPO_SCHEMA": schema, "DPO_HOLD_MS": str(hold_ms)}
    return subprocess.Popen(
        [sys.executable, "-m", "dramatiq_pg_outbox.cli", "scheduler", "--app", "tests.periodic_app"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_three_schedulers_enqueue_each_tick_of_a_one_second_schedule_exactly_once_despite_kill_9(
    database_url: str, db: psycopg.Connection[Any], schema: str
) -> None:
    # Given three scheduler processes on a 1 s schedule; each pass holds the
    # schedule's row lock for 150 ms, so a kill can land inside a pass
    procs = [start_scheduler(database_url, schema, hold_ms=150) for _ in range(3)]
    pids = {p.pid for p in procs}
    began = time.monotonic()
    try:
        wait_for(lambda: bool(stored_keys(db, schema)), 60, "the first tick")
        first = db.execute(f"SELECT min(next_attempt_at) FROM {schema}.messages").fetchone()
        assert first is not None

        def elapsed() -> float:
            return (db_now(db) - first[0]).total_seconds()

        # When, 8 s in, one of them is killed -9 while it is inside a pass
        # (its transaction open, holding the row lock)
        wait_for(lambda: elapsed() >= 8, 30, "8 s of ticks")

        def in_pass() -> int | None:
            row = db.execute(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
                "AND state = 'idle in transaction' AND backend_xid IS NOT NULL "
                "AND application_name LIKE 'dramatiq-pg-outbox:%'"
            ).fetchone()
            pid = int(row[0].split(":")[1]) if row else None
            return pid if pid in pids else None

        seen: list[int] = []

        def caught() -> bool:
            pid = in_pass()
            seen.extend([pid] if pid is not None else [])
            return bool(seen)

        wait_for(caught, 30, "a scheduler inside a pass", interval=0.005)  # (a pass is short)
        victim = seen[0]
        os.killpg(victim, signal.SIGKILL)
        killed = next(p for p in procs if p.pid == victim)
        assert killed.wait(10) == -signal.SIGKILL
        # And the other two run on until 20 s of ticks are enqueued and caught up
        wait_for(lambda: elapsed() >= 20, 60, "20 s of ticks")
        wait_for(lambda: schedule_row(db, schema, "tick")["next_run_at"] > db_now(db), 60, "catch-up")
        survivors = [p for p in procs if p is not killed]
        for proc in survivors:
            proc.send_signal(signal.SIGTERM)
        # Then the survivors stop cleanly on SIGTERM
        for proc in survivors:
            assert proc.wait(30) == 0, proc.stderr.read().decode() if proc.stderr else ""
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    print(f"\nthree schedulers ran for {time.monotonic() - began:.1f}s")
    # And every tick from the first to the last is stored exactly once: no gap, no double
    keys = stored_keys(db, schema)
    ticks = [dt.datetime.fromisoformat(key.split(":", 2)[2].replace("Z", "+00:00")) for key in keys]
    assert len(ticks) >= 21
    expected = [ticks[0] + dt.timedelta(seconds=n) for n in range(len(ticks))]
    assert ticks == expected
    # And no pass claimed a tick that another had claimed (a double claim would
    # count twice in `runs` even though the idempotency key refused its message)
    row = schedule_row(db, schema, "tick")
    assert row["runs"] == len(ticks) and row["last_run_at"] == ticks[-1]
    assert row["missed_ticks"] == 0


# -- the command line ---------------------------------------------------------------------------


def test_the_schedules_command_lists_each_schedule_with_its_last_and_next_run(
    brokers: Callable[..., PostgresBroker],
    db: psycopg.Connection[Any],
    schema: str,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker = brokers()

    @periodic("*/5 * * * *", tz="Europe/Paris", name="rates")
    @periodic(every=60_000, name="beat", missed="skip")
    @periodic("0 3 * * *", name="nightly")
    @dramatiq.actor(broker=broker, queue_name="jobs")
    def job() -> None: ...

    gone = dramatiq.actor(lambda: None, broker=broker, actor_name="gone_actor")
    # Given a schedule that ran, one that no scheduler ran for two hours, and a removed one
    Scheduler(broker, [Schedule(gone, every=60_000, name="gone")]).sync()
    scheduler = Scheduler(broker)
    scheduler.sync()
    tick = last_tick_clear_of_the_next(db, scheduler.schedules["beat"])
    make_due(db, schema, "beat", tick)
    scheduler.run_once()
    db.execute(
        f"UPDATE {schema}.schedules SET next_run_at = now() - interval '2 hours' WHERE name = 'nightly'"
    )
    db.execute(f"UPDATE {schema}.schedules SET removed_at = now() - interval '3 hours' WHERE name = 'gone'")
    # When an operator lists them
    assert main(["schedules", "--url", database_url, "--schema", schema]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Then one table: active schedules by name, the removed one last
    assert lines[0].split() == [
        "name", "actor", "queue", "schedule", "tz", "if", "missed", "last", "run",
        "next", "run", "runs", "missed", "ticks", "status",
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[1:]] == ["beat", "nightly", "rates", "gone"]
    beat, nightly, rates, removed = lines[1:]
    shown_tick = f"{tick:%Y-%m-%d %H:%M:%S}"
    assert "every 60000 ms" in beat and shown_tick in beat and beat.split()[-3:] == ["1", "0", "ok"]
    assert beat.split()[1:3] == ["job", "jobs"] and " skip " in beat
    assert nightly.endswith("late 2 h 00 min: is a scheduler running?")
    assert "*/5 * * * *" in rates and rates.split()[8:10] == ["Europe/Paris", "once"]
    assert rates.endswith("ok")
    assert removed.endswith("removed 3 h 00 min ago") and "gone_actor" in removed
    # And a schedule disabled from the dashboard says so
    db.execute(f"UPDATE {schema}.schedules SET disabled_at = now() WHERE name = 'rates'")
    assert main(["schedules", "--url", database_url, "--schema", schema]) == 0
    rates = capsys.readouterr().out.splitlines()[3]
    assert "disabled since " in rates and rates.endswith("(enable it in the dashboard)")


def test_the_scheduler_command_explains_a_bad_app_in_one_line(
    database_url: str, schema: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dramatiq.broker, "global_broker", dramatiq.broker.global_broker)
    # An app that cannot be imported
    assert main(["scheduler", "--app", "tests.no_such_module"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot import --app tests.no_such_module" in err
    # An app whose module holds no PostgresBroker under that name
    assert main(["scheduler", "--app", "tests.helpers:broker"]) == 2
    assert "tests.helpers.broker is nothing, not a PostgresBroker" in capsys.readouterr().err
    # A --url that is not the app broker's database
    monkeypatch.setenv("DPO_TEST_URL", database_url)
    monkeypatch.setenv("DPO_SCHEMA", schema)
    other = database_url.rsplit("/", 1)[0] + "/postgres"
    assert main(["scheduler", "--app", "tests.periodic_app:broker", "--url", other]) == 2
    assert "--url names another database than the broker of --app" in capsys.readouterr().err
    assert main(["scheduler", "--app", "tests.periodic_app:broker", "--schema", "elsewhere"]) == 2
    assert "--schema elsewhere is not the schema of the broker" in capsys.readouterr().err
    sys.modules.pop("tests.periodic_app", None)


def test_the_scheduler_command_reports_an_app_that_fails_while_imported_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dramatiq.broker, "global_broker", dramatiq.broker.global_broker)
    monkeypatch.delitem(sys.modules, "tests.periodic_app", raising=False)
    # Given an application whose broker URL cannot be parsed (its port is not a number)
    monkeypatch.setenv("DPO_TEST_URL", "postgresql://u:S3cret-pw@db.example:notaport/app")
    # When the scheduler imports it
    code = main(["scheduler", "--app", "tests.periodic_app"])
    # Then one line names the app and its error: a failure of the application, not of this package
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err and "S3cret-pw" not in err
    assert err.startswith(
        "dramatiq-pg-outbox scheduler: error: --app tests.periodic_app failed while it was imported: "
        "ValueError: invalid literal for int()"
    )
    assert "please report it" not in err


# -- the periodic guide's recipe: spreading per-customer work over a window --------------------------


def test_the_spread_recipe_enqueues_one_message_per_customer_over_the_window_once(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str
) -> None:
    broker = brokers()

    @dramatiq.actor(broker=broker)
    def sync_customer(customer_id: int) -> None: ...

    # Given 200 customers and a 10-minute window in steps of 10 seconds
    customers = range(1, 201)
    # When the planning job runs for a tick, then runs again for the same tick (a retry)
    window = {"window_ms": 600_000, "step_ms": 10_000}
    tick = "2026-11-23T00:00:00.000Z"
    planned = spread(broker, sync_customer, customers, tick=tick, rng=random.Random(7), **window)
    spread(broker, sync_customer, customers, tick=tick, **window)
    # Then each customer has exactly one message, due somewhere in the window
    rows = db.execute(
        f"SELECT payload, extract(epoch FROM next_attempt_at - enqueued_at) FROM {schema}.messages"
    ).fetchall()
    assert planned == 200 and len(rows) == 200
    ids = sorted(dramatiq.Message.decode(bytes(payload)).args[0] for payload, _ in rows)
    assert ids == list(customers)
    delays = [float(delay) for _, delay in rows]
    assert all(0 <= d < 600 and d % 10 == 0 for d in delays)
    # And the load is spread: most steps of the window get some, none gets many
    per_step: dict[float, int] = {}
    for d in delays:
        per_step[d] = per_step.get(d, 0) + 1
    assert len(per_step) > 50 and max(per_step.values()) < 12
    # And a run for the next day's tick plans them again
    spread(broker, sync_customer, customers, tick="2026-11-24T00:00:00.000Z", **window)
    assert len(stored_keys(db, schema)) == 400


def test_the_periodic_guide_shows_the_spread_recipe_as_tested() -> None:
    guide = (ROOT / "docs" / "guides" / "periodic.md").read_text()
    assert inspect.getsource(spread) in guide


# -- the migration ----------------------------------------------------------------------------------


def test_revision_0006_adds_the_schedules_table_and_downgrades_cleanly(database_url: str) -> None:
    name = f"periodic_mig_{uuid.uuid4().hex[:8]}"
    # The revision before 0006, whatever the chain is when migrations are merged
    down = ScriptDirectory(script_location()).get_revision("0006").down_revision
    assert isinstance(down, str)

    def exists(conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{name}.schedules",)).fetchone()
        return bool(row and row[0])

    def comment(conn: psycopg.Connection[Any]) -> str:
        row = conn.execute("SELECT obj_description(%s::regclass)", (f"{name}.messages",)).fetchone()
        return str(row[0]) if row else ""

    with psycopg.connect(database_url, autocommit=True) as conn:
        try:
            upgrade(database_url, schema=name, revision="0006")
            assert exists(conn) and comment(conn).endswith("revision 6")
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(
                    f"INSERT INTO {name}.schedules (name, actor_name, queue_name, cron, every_ms, "
                    "next_run_at) VALUES ('x', 'a', 'default', '* * * * *', 1000, now())"
                )
            downgrade(database_url, schema=name, revision=down)
            assert not exists(conn) and comment(conn).endswith(f"revision {int(down)}")
            upgrade(database_url, schema=name, revision="0006")
            assert exists(conn)
        finally:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_run_now_from_the_command_line_and_the_dashboard_makes_the_next_tick_due_once(
    brokers: Callable[..., PostgresBroker], db: psycopg.Connection[Any], schema: str, database_url: str
) -> None:
    import asyncio

    from dramatiq_pg_outbox.dashboard.store import Store
    from tests.test_cli import cli

    broker = brokers()

    @periodic("0 3 * * *", args=(7,), name="nightly")
    @dramatiq.actor(broker=broker)
    def nightly(x: int) -> None: ...

    # Given a nightly schedule whose tick is hours away
    scheduler = Scheduler(broker)
    scheduler.sync()
    before = schedule_row(db, schema, "nightly")["next_run_at"]
    assert before > db_now(db) and scheduler.run_once().enqueued == 0

    # When an operator asks for a dry run, then runs it now from the command line
    dry = cli("schedules", "run-now", "nightly", "--dry-run", "--url", database_url, "--schema", schema)
    assert dry.returncode == 0 and "would be due now" in dry.stdout and "nothing changed" in dry.stdout
    assert schedule_row(db, schema, "nightly")["next_run_at"] == before
    done = cli("schedules", "run-now", "nightly", "--url", database_url, "--schema", schema)
    assert done.returncode == 0 and "is due now" in done.stdout, done.stderr
    again = cli("schedules", "run-now", "nightly", "--url", database_url, "--schema", schema)
    assert "was not changed" in again.stdout  # due already: nothing to do

    # Then the next pass enqueues it once, and the nightly tick stays where it was
    assert scheduler.run_once().enqueued == 1 and scheduler.run_once().enqueued == 0
    payload = db.execute(f"SELECT payload FROM {schema}.messages").fetchone()
    assert payload is not None and dramatiq.Message.decode(bytes(payload[0])).args == (7,)
    assert schedule_row(db, schema, "nightly")["next_run_at"] == before
    assert db.execute(
        f"SELECT target, count FROM {schema}.audit WHERE action = 'schedule-run-now' ORDER BY id"
    ).fetchall() == [("nightly", 1), ("nightly", 0)]  # each asked, with the rows it changed

    # And the dashboard's button runs the same statement: due now, or no change for a disabled one
    async def store_calls() -> tuple[bool, bool, bool]:
        store = Store(database_url, schema, "unused")
        await store.open()
        try:
            first = await store.run_schedule_now("nightly")
            await store.set_schedule_enabled("nightly", False)
            return first, await store.run_schedule_now("nightly"), await store.run_schedule_now("nope")
        finally:
            await store.close()

    assert asyncio.run(store_calls()) == (True, False, False)
