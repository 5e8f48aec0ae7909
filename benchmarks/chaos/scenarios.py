"""The scenarios of the chaos suite (10 and 11 are in pinned.py and checker.py).  Each returns a
:class:`Result`."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from dramatiq import Message
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox.testing import ThrowawayPostgres

from .harness import (
    QUEUE,
    Db,
    Producer,
    Proxy,
    cluster,
    counts,
    gone,
    held_by,
    jitter,
    keys_of_rows,
    long_message,
    lost_keys,
    producer_stats,
    random_keys,
    spawn_producer,
    still_held,
    wait_until,
    work_message,
    worker_ids_of,
)


@dataclass
class Result:
    scenario: str
    messages: int
    lost: int
    duplicates: int
    recovery: str
    notes: str
    ok: bool
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    url: str
    server: ThrowawayPostgres | None
    logdir: Path
    quick: bool
    db: Db
    producer: Producer
    #: Seconds of operations per isolation level of scenario 11 (``--duration``).
    duration: float = 600.0
    #: Scenario 11's seed (``--seed``; None: random).
    seed: int | None = None

    def n(self, full: int, quick: int = 3_000) -> int:
        return quick if self.quick else full

    @property
    def liveness(self) -> dict[str, str]:
        """Broker defaults (heartbeat_timeout 20 s, rescue_interval 5 s), or fast ones with --quick."""
        if not self.quick:
            return {}
        return {
            "CHAOS_HEARTBEAT_INTERVAL": "500",
            "CHAOS_HEARTBEAT_TIMEOUT": "3000",
            "CHAOS_RESCUE_INTERVAL": "1000",
        }

    @property
    def heartbeat_timeout(self) -> float:
        return 3.0 if self.quick else 20.0

    def drained(self) -> bool:
        return int(self.db.value("SELECT count(*) FROM dramatiq.messages")) == 0


class RecoveryTracker:
    """Measures, for each fault, how long until the rows the dead worker held are claimed elsewhere."""

    def __init__(self, db_url: str) -> None:
        self.db = Db(db_url)
        self.pending: list[tuple[float, list[int], list[Any]]] = []
        self.times: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, started: float, ids: list[int], worker_ids: list[Any]) -> None:
        with self._lock:
            self.pending.append((started, ids, worker_ids))

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                items = list(self.pending)
            for item in items:
                started, ids, wids = item
                if not ids or still_held(self.db, ids, wids) == 0:
                    with self._lock:
                        self.pending.remove(item)
                        if ids:
                            self.times.append(time.monotonic() - started)

    def wait(self, timeout: float) -> None:
        wait_until(lambda: not self.pending, timeout, "killed workers' messages to be released")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.db.close()


def _wait_for_workers(ctx: Context, host: Any, timeout: float = 60) -> list[int]:
    """PIDs of the host's worker processes once they have registered (heartbeat row)."""

    def ready() -> bool:
        children = host.children()
        return bool(children) and len(worker_ids_of(ctx.db, children)) == len(children)

    wait_until(ready, timeout, f"{host.name} to register its workers")
    return list(host.children())


def _fmt(seconds: list[float]) -> str:
    if not seconds:
        return "-"
    return f"max {max(seconds):.1f} s (mean {sum(seconds) / len(seconds):.1f} s, n={len(seconds)})"


# -- 1 ------------------------------------------------------------------------


def worker_kill(ctx: Context) -> Result:
    n = ctx.n(20_000)
    keys = random_keys("k", n)
    ctx.producer.send(keys)
    kills = 2 if ctx.quick else 4
    every = 4.0 if ctx.quick else 6.0
    tracker = RecoveryTracker(ctx.url)
    in_flight: set[str] = set()
    try:
        with cluster(ctx.url, ctx.logdir, env={**ctx.liveness, "CHAOS_WORK_MS": "20"}) as sup:
            wait_until(lambda: counts(ctx.db).received >= n * 0.05, 120, "work to start")
            for i in range(kills):
                host = sup.hosts[i % len(sup.hosts)]
                pids = _wait_for_workers(ctx, host)
                victim = random.choice(pids)
                wids = worker_ids_of(ctx.db, [victim])
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()
                ids = held_by(ctx.db, wids)
                in_flight |= keys_of_rows(ctx.db, ids)
                tracker.add(killed_at, ids, wids)
                time.sleep(every)
            wait_until(lambda: counts(ctx.db).received >= n, 600, "every key")
            tracker.wait(120)
            wait_until(ctx.drained, 120, "the queue to drain")
            restarts = sup.restarts
    finally:
        tracker.close()
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, keys))
    unexpected = c.dup_keys - in_flight
    return Result(
        "1. worker kill -9",
        n,
        lost,
        c.duplicates,
        _fmt(tracker.times),
        f"{kills} kills, {restarts} supervisor restarts; {len(in_flight)} messages in flight in killed "
        f"processes; duplicates outside them: {len(unexpected)}",
        lost == 0 and not unexpected,
    )


# -- 2 ------------------------------------------------------------------------


def graceful_restart(ctx: Context) -> Result:
    n = ctx.n(20_000)
    keys = random_keys("k", n)
    ctx.producer.send(keys)
    rounds = 1 if ctx.quick else 2
    times: list[float] = []
    exits: list[float] = []
    left_behind = 0
    with cluster(ctx.url, ctx.logdir, env={**ctx.liveness, "CHAOS_WORK_MS": "20"}) as sup:
        wait_until(lambda: counts(ctx.db).received >= n * 0.1, 120, "work to start")
        for _ in range(rounds):
            for host in sup.hosts:  # a rolling deploy: one host at a time
                pids = _wait_for_workers(ctx, host)
                wids = worker_ids_of(ctx.db, pids)
                proc = host.proc
                assert proc is not None
                held_before = len(held_by(ctx.db, wids))
                host.signal(signal.SIGTERM)
                started = time.monotonic()
                if held_before:
                    # Rows back = none of them processing under the stopped workers any more.
                    wait_until(lambda w=wids: not held_by(ctx.db, w), 120, "rows handed back", poll=0.05)
                    times.append(time.monotonic() - started)
                proc.wait(120)
                exits.append(time.monotonic() - started)
                left_behind += len(held_by(ctx.db, wids))
                _wait_for_workers(ctx, host)
        wait_until(lambda: counts(ctx.db).received >= n, 600, "every key")
        wait_until(ctx.drained, 120, "the queue to drain")
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, keys))
    charged = int(ctx.db.value("SELECT count(*) FROM dramatiq.history WHERE attempts > 1"))
    return Result(
        "2. SIGTERM rolling restart",
        n,
        lost,
        c.duplicates,
        f"SIGTERM -> rows back in queue: {_fmt(times)}; -> process exit: {_fmt(exits)}",
        f"{rounds * len(sup.hosts)} graceful restarts; rows still held after exit: {left_behind}; "
        f"messages charged an extra attempt: {charged}",
        lost == 0 and c.duplicates == 0 and left_behind == 0 and charged == 0,
    )


# -- 3 ------------------------------------------------------------------------


def postgres_restart(ctx: Context) -> Result:
    if ctx.server is None:
        return Result("3. Postgres restart", 0, 0, 0, "-", "skipped: needs the suite's own server", True)
    n = ctx.n(20_000)
    first = random_keys("k", n // 2)
    ctx.producer.send(first)
    second = n - len(first)
    batch = 10
    duration = 20.0 if ctx.quick else 40.0
    producer = spawn_producer(
        ctx.url,
        ["--prefix", "p", "--count", str(second), "--batch", str(batch), "--retry",
         "--rate", str(second / batch / duration)],
        ctx.logdir / "producer-restart.log",
    )  # fmt: skip
    try:
        with cluster(ctx.url, ctx.logdir, env={**ctx.liveness, "CHAOS_WORK_MS": "20"}):
            wait_until(lambda: counts(ctx.db).received >= n * 0.2, 120, "work to start")
            started = time.monotonic()
            ctx.db.close()
            ctx.producer.close()
            ctx.server.restart("fast")
            up = time.monotonic()
            db_up = ctx.db.value("SELECT now()")
            wait_until(
                lambda: bool(
                    ctx.db.value("SELECT count(*) FROM dramatiq.history WHERE started_at >= %s", (db_up,))
                ),
                120,
                "a message claimed and acked after the restart",
                poll=0.05,
            )
            recovered = time.monotonic()
            stats = producer_stats(producer)
            committed = int(ctx.db.value("SELECT count(*) FROM chaos_orders"))
            wait_until(lambda: counts(ctx.db).received >= committed, 600, "every committed key")
            wait_until(ctx.drained, 120, "the queue to drain")
    finally:
        if producer.poll() is None:
            producer.kill()
    sent = {r[0] for r in ctx.db.rows("SELECT key FROM chaos_orders")}
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, sent))
    return Result(
        "3. Postgres restart (fast)",
        len(sent),
        lost,
        c.duplicates,
        f"workers: {recovered - started:.1f} s from shutdown (server down {up - started:.1f} s; "
        f"first ack {recovered - up:.2f} s after it accepted connections); "
        f"producer: {stats.get('outage_s', 0):.1f} s",
        f"producer retried {stats.get('errors', 0)} failed transactions "
        f"({stats.get('already_committed', 0)} keys had committed before the error)",
        lost == 0 and len(sent) == n,
    )


# -- 4 ------------------------------------------------------------------------


def _terminate_connections(db: Db) -> int:
    return int(
        db.value(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        )
    )


def _listeners(db: Db) -> int:
    return int(
        db.value(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %%'"
        )
    )


def connection_kill(ctx: Context) -> Result:
    n = ctx.n(20_000)
    keys = random_keys("k", n)
    ctx.producer.send(keys)
    ctx.producer.close()  # only the workers' connections are in the database now
    # Idle consumers poll only every 30 s here: a fast pick-up after the kills proves NOTIFY works again.
    env = {**ctx.liveness, "CHAOS_WORK_MS": "10", "CHAOS_MAX_FETCH_INTERVAL": "30000"}
    times: list[float] = []
    listen_back: list[float] = []
    killed = 0
    workers = 4
    with cluster(ctx.url, ctx.logdir, env=env) as sup:
        for fraction in (0.2, 0.5):
            wait_until(lambda f=fraction: counts(ctx.db).received >= n * f, 300, "progress")
            wait_until(lambda: _listeners(ctx.db) == workers, 60, "every worker to LISTEN")
            db_now = ctx.db.value("SELECT now()")
            killed += _terminate_connections(ctx.db)
            started = time.monotonic()
            wait_until(
                lambda t=db_now: bool(
                    ctx.db.value("SELECT count(*) FROM dramatiq.history WHERE started_at > %s", (t,))
                ),
                120,
                "a message claimed and acked after the kill",
                poll=0.05,
            )
            times.append(time.monotonic() - started)
            listen_back.append(wait_until(lambda: _listeners(ctx.db) == workers, 60, "LISTEN to come back"))
        wait_until(lambda: counts(ctx.db).received >= n, 600, "every key")
        wait_until(ctx.drained, 120, "the queue to drain")
        time.sleep(2)  # every consumer idle, next poll ~30 s away
        latencies = []
        for i in range(5):
            key = f"probe{i}"
            started = time.monotonic()
            ctx.producer.send_message(work_message(key), key)
            wait_until(lambda k=key: bool(ctx.db.rows("SELECT 1 FROM chaos_received WHERE key = %s", (k,))),
                       30, "the probe", poll=0.01)  # fmt: skip
            latencies.append(time.monotonic() - started)
            time.sleep(0.5)
        restarts = sup.restarts
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, keys))
    notify_ok = max(latencies) < 5
    return Result(
        "4. connection kill",
        n,
        lost,
        c.duplicates,
        f"processing again after {_fmt(times)}; LISTEN back after {_fmt(listen_back)}",
        f"2 rounds, {killed} backends terminated, {restarts} worker restarts; wake-up latency after: "
        f"max {max(latencies) * 1000:.0f} ms with a 30 s poll interval",
        lost == 0 and restarts == 0 and notify_ok,
    )


# -- 5 ------------------------------------------------------------------------


def poison(ctx: Context) -> Result:
    n = ctx.n(20_000)
    keys = random_keys("k", n)
    poisons = [f"poison{i}" for i in range(2 if ctx.quick else 5)]
    step = n // (len(poisons) + 1)
    order = list(keys)
    for i, key in enumerate(poisons):
        order.insert((i + 1) * step + i, key)
    ctx.producer.send(order)
    max_deliveries = 5
    started = time.monotonic()
    with cluster(ctx.url, ctx.logdir, env={**ctx.liveness, "CHAOS_WORK_MS": "10"}) as sup:
        ordinary_done = wait_until(lambda: counts(ctx.db).received >= n, 900, "the ordinary messages")
        wait_until(
            lambda: (
                int(ctx.db.value("SELECT count(*) FROM dramatiq.history WHERE state = 'failed'"))
                >= len(poisons)
            ),
            900,
            "the poison messages to be quarantined",
        )
        poison_done = time.monotonic() - started
        wait_until(ctx.drained, 120, "the queue to drain")
        restarts = sup.restarts
    c = counts(ctx.db, "k")
    lost = len(lost_keys(ctx.db, keys))
    failed = ctx.db.rows("SELECT payload, attempts, error_type FROM dramatiq.history WHERE state = 'failed'")
    from dramatiq import Message

    failed_keys = {str(Message.decode(bytes(p)).args[0]): (a, t) for p, a, t in failed}
    runs = dict(ctx.db.rows("SELECT key, count(*) FROM chaos_started GROUP BY key"))
    # Each poison is charged max_deliveries claims; it runs at most that often (a claim whose process
    # another poison killed first is charged without running).
    as_expected = set(failed_keys) == set(poisons) and all(
        failed_keys[k] == (max_deliveries, "MaxDeliveriesExceeded") and 1 <= runs.get(k, 0) <= max_deliveries
        for k in poisons
    )
    innocents = sorted(set(failed_keys) - set(poisons))
    return Result(
        "5. poison message (os._exit)",
        n + len(poisons),
        lost,
        c.duplicates,
        f"ordinary done after {ordinary_done:.0f} s; poison quarantined after {poison_done:.0f} s",
        f"{len(poisons)} poison messages ran {sorted(runs.get(k, 0) for k in poisons)} times, all charged "
        f"{max_deliveries} deliveries and in history as failed: {as_expected}; innocent messages "
        f"quarantined: {len(innocents)}; "
        f"{restarts} supervisor restarts",
        lost == 0 and as_expected and not innocents,
    )


# -- 6 ------------------------------------------------------------------------


def long_task(ctx: Context) -> Result:
    n = ctx.n(20_000)
    seconds = ctx.heartbeat_timeout * 2 + (2 if ctx.quick else 5)
    longs = [f"long{i}" for i in range(4)]
    for key in longs:
        ctx.producer.send_message(long_message(key, seconds), key)
    keys = random_keys("k", n)
    ctx.producer.send(keys)
    with cluster(ctx.url, ctx.logdir, env={**ctx.liveness, "CHAOS_WORK_MS": "10"}):
        wait_until(lambda: counts(ctx.db).received >= n + len(longs), 900, "every key")
        wait_until(ctx.drained, 120, "the queue to drain")
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, keys + longs))
    runs = dict(ctx.db.rows("SELECT key, count(*) FROM chaos_started GROUP BY key"))
    twice = [k for k in longs if runs.get(k, 0) != 1]
    return Result(
        "6. long task (> heartbeat timeout)",
        n + len(longs),
        lost,
        c.duplicates,
        "-",
        f"{len(longs)} tasks of {seconds:.0f} s (heartbeat_timeout {ctx.heartbeat_timeout:.0f} s) beside "
        f"{n} short ones; long tasks started more than once: {len(twice)}",
        lost == 0 and c.duplicates == 0 and not twice,
    )


# -- 7 ------------------------------------------------------------------------


def producer_failure(ctx: Context) -> Result:
    target = ctx.n(20_000)  # committed messages wanted
    chunk = 1_000 if not ctx.quick else 500
    slots = 3
    total = 0
    running: list[Any] = []
    kills = 0
    stats: list[dict[str, Any]] = []
    with cluster(ctx.url, ctx.logdir, env=ctx.liveness):
        next_kill = time.monotonic() + 1.0
        committed_so_far = 0
        while running or committed_so_far < target:
            for proc in [p for p in running if p.poll() is not None]:
                running.remove(proc)
                if proc.returncode == 0:
                    stats.append(producer_stats(proc))
            committed_so_far = int(ctx.db.value("SELECT count(*) FROM chaos_orders"))
            while committed_so_far < target and len(running) < slots:
                args = ["--prefix", "o", "--start", str(total), "--count", str(chunk),
                        "--batch", "5", "--rollback-rate", "0.2", "--hold-ms", "20"]  # fmt: skip
                running.append(spawn_producer(ctx.url, args, ctx.logdir / "producers.log"))
                total += chunk
            if running and time.monotonic() >= next_kill:
                victim = random.choice(running)
                if victim.poll() is None:
                    victim.kill()
                    victim.wait()
                    kills += 1
                running.remove(victim)
                next_kill = time.monotonic() + random.uniform(1.0, 3.0)
            time.sleep(0.1)
        committed = {r[0] for r in ctx.db.rows("SELECT key FROM chaos_orders")}
        wait_until(lambda: counts(ctx.db).received >= len(committed), 600, "every committed key")
        wait_until(ctx.drained, 120, "the queue to drain")
        time.sleep(1)
    received = {r[0] for r in ctx.db.rows("SELECT key FROM chaos_received")}
    c = counts(ctx.db)
    history = int(ctx.db.value("SELECT count(*) FROM dramatiq.history WHERE state = 'completed'"))
    lost = len(committed - received)
    phantom = len(received - committed)
    rolled_back = sum(s.get("rolled_back", 0) for s in stats)
    return Result(
        "7. producer rollback / kill -9",
        len(committed),
        lost,
        c.duplicates,
        "-",
        f"{total} keys given to {total // chunk} producer processes ({kills} killed -9 mid-run; the others "
        f"rolled back {rolled_back} keys on purpose); messages without a committed row: {phantom}; "
        f"history rows: {history}",
        lost == 0 and phantom == 0 and history == len(committed) and c.duplicates == 0,
    )


# -- 8 ------------------------------------------------------------------------


def _dead_tuples(db: Db) -> int:
    return int(
        db.value(
            "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
            "WHERE relid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages'))"
        )
    )


def pressure(ctx: Context) -> Result:
    phases = (("before", 10.0), ("during", 30.0), ("after", 20.0)) if ctx.quick else (
        ("before", 30.0), ("during", 120.0), ("after", 60.0))  # fmt: skip
    rate = 120.0  # messages per second, sent in 4 transactions per second
    stop = threading.Event()
    sent: list[str] = []

    def produce() -> None:
        i = 0
        start = time.monotonic()
        tick = 0
        while not stop.is_set():
            tick += 1
            batch = [f"k{i + j:06d}" for j in range(int(rate / 4))]
            ctx.producer.send(batch)
            sent.extend(batch)
            i += len(batch)
            time.sleep(max(0.0, start + tick / 4 - time.monotonic()))

    report: list[str] = []
    samples: dict[str, dict[str, float]] = {}
    holder: psycopg.Connection[Any] | None = None
    released = time.monotonic()
    released_db: Any = None
    with cluster(ctx.url, ctx.logdir, env={**ctx.liveness, "CHAOS_WORK_MS": "5"}):
        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        wait_until(lambda: counts(ctx.db).received > 0, 60, "work to start")
        for name, seconds in phases:
            if name == "during":
                holder = psycopg.connect(ctx.url)
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM dramatiq.messages")
            done0 = int(ctx.db.value("SELECT count(*) FROM dramatiq.history"))
            t0 = time.monotonic()
            db_t0 = ctx.db.value("SELECT now()")
            peak_dead = 0
            peak_backlog = 0
            while time.monotonic() - t0 < seconds:
                time.sleep(1)
                peak_dead = max(peak_dead, _dead_tuples(ctx.db))
                peak_backlog = max(peak_backlog, int(ctx.db.value("SELECT count(*) FROM dramatiq.messages")))
            done = int(ctx.db.value("SELECT count(*) FROM dramatiq.history")) - done0
            latency = ctx.db.value(
                "SELECT coalesce(extract(epoch FROM avg(finished_at - enqueued_at)), 0) "
                "FROM dramatiq.history WHERE finished_at >= %s",
                (db_t0,),
            )
            samples[name] = {
                "throughput": done / (time.monotonic() - t0),
                "dead_end": _dead_tuples(ctx.db),
                "dead_peak": peak_dead,
                "backlog_peak": peak_backlog,
                "latency_ms": float(latency) * 1000,
            }
            if holder is not None and name == "during":
                holder.rollback()
                holder.close()
                holder = None
                released = time.monotonic()
                released_db = ctx.db.value("SELECT now()")
        # Recovery: autovacuum gets to the hot table once the snapshot is gone (load still running).
        wait_until(
            lambda: bool(
                ctx.db.value(
                    "SELECT count(*) FROM pg_stat_user_tables "
                    "WHERE relid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages')) "
                    "AND greatest(last_autovacuum, last_vacuum) > %s",
                    (released_db,),
                )
            ),
            300,
            "autovacuum of the messages table",
            poll=1,
        )
        vacuumed = time.monotonic() - released
        dead_after_vacuum = _dead_tuples(ctx.db)
        stop.set()
        thread.join()
        wait_until(lambda: counts(ctx.db).received >= len(sent), 300, "every key")
        wait_until(ctx.drained, 120, "the queue to drain")
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, sent))
    for name, s in samples.items():
        report.append(
            f"{name}: {s['throughput']:.0f} msg/s, latency {s['latency_ms']:.0f} ms, backlog peak "
            f"{s['backlog_peak']:.0f}, dead tuples peak {s['dead_peak']:.0f} / end {s['dead_end']:.0f}"
        )
    during = samples["during"]["throughput"]
    return Result(
        f"8. pressure ({phases[1][1]:.0f} s REPEATABLE READ)",
        len(sent),
        lost,
        c.duplicates,
        f"autovacuum of the hot table {vacuumed:.0f} s after the long transaction ended",
        "; ".join(report) + f"; dead tuples after that vacuum: {dead_after_vacuum}",
        lost == 0 and c.duplicates == 0 and during >= rate * 0.8,
        extra=samples,
    )


# -- 9 ------------------------------------------------------------------------


def _follow_up_messages(n: int) -> tuple[list[tuple[str, Message[Any]]], list[str]]:
    """(business key, message) pairs: half ``flaky`` (fails once, retried), a quarter two-step
    pipelines, a quarter ``succeed`` with an ``on_success`` callback; and the keys expected in
    ``chaos_received`` (each recorded only by the follow-up: the retry, step two, the callback)."""
    pairs: list[tuple[str, Message[Any]]] = []
    for i in range(n):
        key = f"f{i:06d}"
        kind = i % 4
        if kind < 2:
            message = Message(queue_name=QUEUE, actor_name="flaky", args=(key,), kwargs={}, options={})
        elif kind == 2:
            second = Message(queue_name=QUEUE, actor_name="step_two", args=(), kwargs={}, options={})
            message = Message(
                queue_name=QUEUE, actor_name="step_one", args=(key,), kwargs={},
                options={"pipe_target": second.asdict()},
            )  # fmt: skip
        else:
            message = Message(
                queue_name=QUEUE,
                actor_name="succeed",
                args=(key,),
                kwargs={},
                options={"on_success": "on_done"},
            )
        pairs.append((key, message))
    return pairs, [key for key, _ in pairs]


def _until_an_ack(ctx: Context, what: str) -> float:
    """Seconds from now until a message is archived (acked) after now on the database clock."""
    db_now = ctx.db.value("SELECT now()")
    query = "SELECT count(*) FROM dramatiq.history WHERE finished_at > %s"
    return wait_until(lambda: bool(ctx.db.value(query, (db_now,))), 120, what, poll=0.05)


def outage_follow_ups(ctx: Context) -> Result:
    """Database outages while actors fail and are retried, pipelines advance and callbacks fire.

    The workers reach PostgreSQL through a TCP proxy that the suite cuts (every connection
    closed, new ones refused) for a few seconds, twice; then, with the suite's own server, a
    fast restart.  Every retry, next step and callback is written in the transaction of the
    ack that caused it, so each key must arrive.
    """
    n = ctx.n(20_000)
    pairs, keys = _follow_up_messages(n)
    ctx.producer.send_messages(pairs)
    url = make_url(ctx.url)
    proxy = Proxy((url.host or "127.0.0.1", url.port or 5432))
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    # Shorter than heartbeat_timeout: the workers are alive throughout, so any duplicate would be a defect.
    cut_s = 2.0 if ctx.quick else 5.0
    env = {**ctx.liveness, "CHAOS_WORK_MS": "5", "CHAOS_RECORD_URL": ctx.url}
    cuts: list[str] = []
    recoveries: list[float] = []
    try:
        with cluster(proxied, ctx.logdir, env=env) as sup:
            for fraction in (0.2, 0.45):
                wait_until(lambda f=fraction: counts(ctx.db).received >= n * f, 300, "progress")
                proxy.block()
                time.sleep(cut_s)
                proxy.unblock()
                recoveries.append(_until_an_ack(ctx, "an ack after the outage"))
                cuts.append(f"proxy cut {cut_s:.0f} s")
            if ctx.server is not None:
                wait_until(lambda: counts(ctx.db).received >= n * 0.7, 300, "progress")
                ctx.db.close()
                ctx.producer.close()
                ctx.server.restart("fast")
                recoveries.append(_until_an_ack(ctx, "an ack after the restart"))
                cuts.append("PostgreSQL restart")
            wait_until(lambda: counts(ctx.db).received >= n, 600, "every key's follow-up")
            wait_until(ctx.drained, 120, "the queue to drain")
            restarts = sup.restarts
    finally:
        proxy.close()
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, keys))
    flaky_keys = [k for i, k in enumerate(keys) if i % 4 < 2]
    retried = int(ctx.db.value("SELECT count(*) FROM chaos_attempts WHERE n >= 2"))
    history = dict(
        ctx.db.rows(
            "SELECT state || coalesce('/' || error_type, ''), count(*) FROM dramatiq.history GROUP BY 1"
        )
    )
    return Result(
        "9. outage while retrying (follow-ups)",
        n,
        lost,
        c.duplicates,
        f"acks again {_fmt(recoveries)} after each outage ended",
        f"outages: {', '.join(cuts)}; {retried} of {len(flaky_keys)} failing messages retried and run, "
        f"{n - len(flaky_keys)} pipeline steps and callbacks run; history {history}; "
        f"{restarts} worker restarts",
        lost == 0 and retried == len(flaky_keys),
    )


# -- 12 -----------------------------------------------------------------------

#: Scenario 12's concurrency keys: 30 keys, limits 1, 2 and 3 in turn.
KEY_LIMITS = {f"chaos:{i:02d}": 1 + i % 3 for i in range(30)}


def _keyed_messages(n: int, rng: random.Random) -> list[tuple[str, Message[Any]]]:
    """(business key, message) pairs: ``keyed_work`` of 20-180 ms, four in five with a key of
    :data:`KEY_LIMITS` (and its limit), the rest without one; keys interleaved at random."""
    keys = list(KEY_LIMITS)
    pairs = []
    for i in range(n):
        options: dict[str, Any] = {}
        if i % 5:
            ckey = rng.choice(keys)
            options = {"concurrency_key": ckey, "concurrency_limit": KEY_LIMITS[ckey]}
        business = f"q{i:06d}"
        message: Message[Any] = Message(
            queue_name=QUEUE, actor_name="keyed_work", args=(business, rng.randint(20, 180)), kwargs={},
            options=options,
        )  # fmt: skip
        pairs.append((business, message))
    return pairs


def most_at_once(intervals: Iterable[tuple[Any, Any]]) -> int:
    """The largest number of the intervals ``(start, end)`` that overlap at one instant (one that
    ends as another starts does not overlap it)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def key_limits(ctx: Context) -> Result:
    """Concurrency keys under ``kill -9`` of worker processes and PostgreSQL restarts.

    Three hosts of one worker process and 4 threads drain keyed messages (30 keys, limits 1, 2
    and 3) and unkeyed ones while the suite kills a worker process with ``kill -9`` (the
    supervisor restarts its CLI) and restarts PostgreSQL (``fast``).  Each delivery records its
    start and end (``chaos_spans``); history's ``started_at`` cannot serve, it is the claim's time
    and keeps only a message's last delivery.  A delivery that a kill cut has no end: its interval
    ends at the time its process was seen dead (on the database clock, taken once the process is
    gone), when the actor died with it.  The check: for each key, the most intervals overlapping
    at one instant is at most the key's limit.
    """
    n = ctx.n(20_000)
    rng = random.Random(12)
    pairs = _keyed_messages(n, rng)
    ctx.producer.send_messages(pairs)
    faults = ["kill", "restart", "kill", "kill"] if ctx.quick else (
        ["kill", "kill", "restart", "kill", "kill", "restart", "kill", "kill"])  # fmt: skip
    if ctx.server is None:
        faults = [f for f in faults if f != "restart"]
    every = 5.0 if ctx.quick else 15.0
    killed_at: dict[int, Any] = {}  # pid -> the database's clock once that process was gone
    restarts_done = 0
    env = {**ctx.liveness}
    cut = 0
    with cluster(ctx.url, ctx.logdir, hosts=3, processes=1, threads=4, env=env) as sup:
        wait_until(lambda: counts(ctx.db).received >= n * 0.05, 120, "work to start")
        for i, fault in enumerate(faults):
            if fault == "kill":
                host = sup.hosts[i % len(sup.hosts)]
                victim = _wait_for_workers(ctx, host)[0]
                os.kill(victim, signal.SIGKILL)
                wait_until(partial(gone, victim), 10, "the killed process to die", poll=0.01)
                killed_at[victim] = ctx.db.value("SELECT clock_timestamp()")
                open_spans = "SELECT count(*) FROM chaos_spans WHERE pid = %s AND ended IS NULL"
                cut += int(ctx.db.value(open_spans, (victim,)))
            else:
                assert ctx.server is not None
                ctx.db.close()
                ctx.producer.close()
                ctx.server.restart("fast")
                restarts_done += 1
            time.sleep(jitter(every))
        wait_until(lambda: counts(ctx.db).received >= n, 900, "every key")
        wait_until(ctx.drained, 120, "the queue to drain")
        worker_restarts = sup.restarts
    spans = ctx.db.rows("SELECT message_id, ckey, pid, started, ended FROM chaos_spans ORDER BY started")
    by_key: dict[str, list[tuple[Any, Any]]] = {}
    unexplained = 0  # intervals without an end whose process was not killed
    for _message_id, ckey, pid, started, ended in spans:
        if ended is None:
            if pid not in killed_at:
                unexplained += 1
                continue
            ended = max(started, killed_at[pid])  # (a start the server wrote as the process died)
        by_key.setdefault(ckey or "", []).append((started, ended))
    free = by_key.pop("", [])
    peaks = {ckey: most_at_once(intervals) for ckey, intervals in by_key.items()}
    over = sorted(ckey for ckey, peak in peaks.items() if peak > KEY_LIMITS[ckey])
    at_limit = sum(1 for ckey, peak in peaks.items() if peak == KEY_LIMITS[ckey])
    # A re-run is a delivery after a message's first (in start order).  Each must follow a delivery
    # in a killed process: one the kill cut (no end), or one that ended before its ack was written.
    earlier: dict[str, list[tuple[int, Any]]] = {}
    reruns = after_cut = after_end = unexplained_reruns = 0
    for message_id, _ckey, pid, _started, ended in spans:
        previous = earlier.setdefault(message_id, [])
        if previous:
            reruns += 1
            last_pid, last_end = previous[-1]
            if last_pid not in killed_at:
                unexplained_reruns += 1
            elif last_end is None:
                after_cut += 1
            else:
                after_end += 1
        previous.append((pid, ended))
    completed = int(
        ctx.db.value("SELECT count(DISTINCT message_id) FROM dramatiq.history WHERE state = 'completed'")
    )
    not_completed = int(ctx.db.value("SELECT count(*) FROM dramatiq.history WHERE state <> 'completed'"))
    charged = int(ctx.db.value("SELECT count(*) FROM dramatiq.history WHERE attempts > 1"))
    c = counts(ctx.db)
    lost = len(lost_keys(ctx.db, [key for key, _ in pairs]))
    by_limit = {
        limit: max((peaks.get(k, 0) for k, lim in KEY_LIMITS.items() if lim == limit), default=0)
        for limit in (1, 2, 3)
    }
    ok = (
        lost == 0
        and not over
        and unexplained == 0
        and completed == n
        and not_completed == 0
        and unexplained_reruns == 0
        and len(by_key) == len(KEY_LIMITS)
    )
    return Result(
        "12. concurrency keys under kill -9 / restarts",
        n,
        lost,
        c.duplicates,
        "-",
        f"{len(KEY_LIMITS)} keys (limits 1, 2, 3) + {len(free)} unkeyed deliveries; "
        f"{faults.count('kill')} kills ({cut} deliveries cut mid-run), {restarts_done} PostgreSQL restarts, "
        f"{worker_restarts} supervisor restarts; most running at once per limit {by_limit} "
        f"(keys above their limit: {len(over)}{': ' + ', '.join(over) if over else ''}; "
        f"at their limit at some instant: {at_limit} of {len(KEY_LIMITS)}); unkeyed at once: "
        f"{most_at_once(free)}; {len(spans)} deliveries recorded, {reruns} re-runs ({after_cut} after a "
        f"delivery the kill cut, {after_end} after one that ended before its ack, {unexplained_reruns} "
        f"after a delivery in a process not killed), {charged} messages "
        f"charged more than one attempt; completed in history: {completed} of {n}, other states: "
        f"{not_completed}; open intervals outside killed processes: {unexplained}",
        ok,
        extra={"peaks": peaks, "killed": len(killed_at), "reruns": reruns, "cut": cut},
    )


SCENARIOS = {
    1: worker_kill,
    2: graceful_restart,
    3: postgres_restart,
    4: connection_kill,
    5: poison,
    6: long_task,
    7: producer_failure,
    8: pressure,
    9: outage_follow_ups,
    12: key_limits,
}
