"""Scenarios 13 and 14: the primary dies and its streaming standby is promoted, under load.

Each scenario starts two servers of its own (``ThrowawayPostgres``: a primary and a hot
standby made by ``pg_basebackup``, PostgreSQL's streaming replication), in synchronous
(13: ``synchronous_standby_names`` names the standby, ``synchronous_commit = on``) or
asynchronous (14) replication.  Producers (``benchmarks.chaos.producer --mix``) commit
business rows with their messages inside ``outbox()`` (work, failing-then-retried actors,
pipelines, callbacks), and supervised ``dramatiq`` CLI workers drain them; all are given
the multi-host URL ``postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/failover?
target_session_attrs=read-write``.  After a quarter of the keys ran, every process of the
primary is killed with SIGKILL (``ThrowawayPostgres.kill_all``: the postmaster, its
backends and its WAL sender, as a machine that dies) and the standby is promoted; the old
primary is never started again.

The actors record their deliveries in the suite's own database (``CHAOS_RECORD_URL``, a
third server that never fails), so what ran is known whatever the failover lost.  Each
producer appends a key to its log once its transaction's commit returned.  At the end, on
the new primary:

- **consistency**: every business row has its message (in ``messages`` or ``history``)
  and every message its business row;
- **lost**: keys whose commit a producer saw but the new primary does not hold (must be 0
  with a synchronous standby; with an asynchronous one, the business rows were lost too);
- **ran**: every business row of the new primary ran (the ledger has its key);
- **duplicates**: deliveries beyond the first per key (a claim or ack the new primary
  never received: the message runs again), and, asynchronous only, keys that ran although
  the failover lost their transaction.

The recovery column is the time from the promoted standby accepting writes to the first
ack written there, with the workers, their LISTEN connections, their periodic schedulers
(``chaos_tick``, every second: a run enqueued on the new primary must complete), a
``dramatiq-pg-outbox relay`` process moving a queue to Redis (messages sent after the
promotion must reach Redis; skipped where no Redis answers) and the producers never
restarted (the supervisor counts restarts; any fails the scenario).
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from dramatiq import Message
from psycopg import sql

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.testing import ThrowawayPostgres

from .harness import ROOT, TABLES, Db, cluster, counts, producer_stats, spawn_producer, wait_until
from .scenarios import Context, Result

DATABASE = "failover"
#: The relay's target (``dramatiq-pg-outbox relay --to``); the relay part is skipped without it.
REDIS_URL = "redis://127.0.0.1:6379/0"
#: Messages sent to the relayed queue before the kill, and again after the promotion.
RELAYED = 20
#: Actors whose first argument is the business key (the first message of each key).
FIRST_ACTORS = ("work", "flaky", "step_one", "succeed")
PRODUCERS = 2


def multi_host_url(primary: ThrowawayPostgres, standby: ThrowawayPostgres, dbname: str) -> str:
    """The URL every process is given: both servers, the one that accepts writes chosen."""
    return (
        f"postgresql://postgres@{primary.host}:{primary.port},{standby.host}:{standby.port}/{dbname}"
        "?target_session_attrs=read-write&connect_timeout=2"
    )


def message_keys(db: Db) -> set[str]:
    """Business keys of the messages the database holds, waiting or finished."""
    keys: set[str] = set()
    for table in ("messages", "history"):
        query = f"SELECT payload FROM dramatiq.{table} WHERE actor_name = ANY(%s)"  # noqa: S608
        for (payload,) in db.rows(query, (list(FIRST_ACTORS),)):
            args = Message.decode(bytes(payload)).args
            if args:
                keys.add(str(args[0]))
    return keys


class RelayCheck:
    """A ``dramatiq-pg-outbox relay`` process moving one queue to Redis through the failover.

    ``send(n)`` stores ``n`` messages of that queue on the primary (retrying while no primary
    answers); ``moved()`` is how many reached Redis (Dramatiq's ``dramatiq:<queue>.msgs`` hash).
    """

    def __init__(self, url: str, logdir: Path) -> None:
        import redis

        self.queue = f"chaos_relayed_{secrets.token_hex(3)}"
        self.redis = redis.Redis.from_url(REDIS_URL)
        self.redis.ping()
        self.broker = PostgresBroker(url=url)
        self.sent = 0
        with open(logdir / "relay-failover.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq_pg_outbox.cli", "relay", "--url", url, "--to", REDIS_URL,
                 "--queues", self.queue, "--report-every", "0"],
                cwd=ROOT, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip

    def send(self, n: int, timeout: float = 60) -> None:
        messages = [
            Message(
                queue_name=self.queue, actor_name="relayed_job", args=(self.sent + i,), kwargs={}, options={}
            )
            for i in range(n)
        ]
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.broker.enqueue_many(messages)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.sent += n

    def moved(self) -> int:
        return int(self.redis.hlen(f"dramatiq:{self.queue}.msgs"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for key in self.redis.scan_iter(f"dramatiq:{self.queue}*"):
            self.redis.delete(key)
        self.redis.close()
        self.broker.close()


@contextlib.contextmanager
def relay_check(url: str, logdir: Path) -> Iterator[RelayCheck | None]:
    """A :class:`RelayCheck`, or None where Redis or its client is missing."""
    try:
        check = RelayCheck(url, logdir)
    except Exception:
        yield None
        return
    try:
        yield check
    finally:
        check.close()


def _ledger_keys(ctx: Context) -> set[str]:
    return {r[0] for r in ctx.db.rows("SELECT key FROM chaos_received")}


def _committed(logs: list[Path]) -> set[str]:
    keys: set[str] = set()
    for log in logs:
        if log.exists():
            keys |= {line for line in log.read_text().splitlines() if line}
    return keys


def _failover(ctx: Context, *, synchronous: bool) -> Result:
    label = (
        f"{13 if synchronous else 14}. failover, {'synchronous' if synchronous else 'asynchronous'} standby"
    )
    with ThrowawayPostgres({"max_connections": 200}) as primary:
        standby = primary.start_standby(synchronous=synchronous)
        try:
            return _run(ctx, label, primary, standby, synchronous)
        finally:
            standby.stop("immediate")


def _run(
    ctx: Context, label: str, primary: ThrowawayPostgres, standby: ThrowawayPostgres, synchronous: bool
) -> Result:
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    direct = primary.url_for(DATABASE)
    upgrade(direct, schema="dramatiq")
    with psycopg.connect(direct, autocommit=True) as conn:
        conn.execute(TABLES)
    standby.wait_replayed()
    url = multi_host_url(primary, standby, DATABASE)

    n = ctx.n(12_000, 1_200)
    per = n // PRODUCERS
    duration = 8.0 if ctx.quick else 40.0
    batch = 5
    logs = [ctx.logdir / f"failover-{label[:2]}-committed-{i}.log" for i in range(PRODUCERS)]
    for log in logs:
        log.unlink(missing_ok=True)
    producers = []
    for i in range(PRODUCERS):
        args = ["--prefix", f"x{i}", "--count", str(per), "--batch", str(batch), "--retry", "--mix",
                "--rate", str(per / batch / duration), "--committed-log", str(logs[i])]  # fmt: skip
        producers.append(spawn_producer(url, args, ctx.logdir / "producer-failover.log"))
    env = {**ctx.liveness, "CHAOS_WORK_MS": "5", "CHAOS_RECORD_URL": ctx.url, "CHAOS_PERIODIC": "1"}
    new = Db(standby.url_for(DATABASE))
    relay_note = "relay: skipped (no Redis at 127.0.0.1:6379)"
    relay_ok = True
    try:
        with cluster(url, ctx.logdir, env=env) as sup, relay_check(url, ctx.logdir) as relay:
            if relay is not None:
                relay.send(RELAYED)
            wait_until(lambda: counts(ctx.db).received >= n * 0.25, 300, "a quarter of the keys to run")
            killed_at = time.monotonic()
            killed = primary.kill_all()
            standby.promote()
            up = time.monotonic()
            db_up = new.value("SELECT now()")
            first_ack = wait_until(
                lambda: bool(
                    new.value("SELECT count(*) FROM dramatiq.history WHERE finished_at >= %s", (db_up,))
                ),
                120,
                "the first ack on the new primary",
                poll=0.02,
            )
            # A run of the periodic job that its scheduler enqueued on the new primary
            tick_query = (
                "SELECT count(*) FROM dramatiq.history WHERE actor_name = 'chaos_tick' "
                "AND state = 'completed' AND enqueued_at >= %s"
            )
            first_tick = wait_until(
                lambda: bool(new.value(tick_query, (db_up,))), 120, "a periodic job's run after the failover"
            )
            if relay is not None:
                relay.send(RELAYED)
                moved = wait_until(
                    lambda: relay.moved() >= relay.sent, 120, "the relay to move the messages sent after it"
                )
                relay_note = (
                    f"relay to Redis: {relay.moved()} of {relay.sent} messages moved "
                    f"({RELAYED} sent after the promotion, all there {moved:.1f} s later)"
                )
                relay_ok = relay.moved() >= relay.sent
            stats = [producer_stats(p) for p in producers]
            # A producer that raised what its retry does not catch stopped short of its count
            failed = sum(p.returncode != 0 for p in producers)
            orders = {r[0] for r in new.rows("SELECT key FROM chaos_orders")}
            wait_until(
                lambda: orders <= _ledger_keys(ctx), 600, "every business row of the new primary to run"
            )
            wait_until(
                lambda: int(new.value("SELECT count(*) FROM dramatiq.messages")) == 0,
                300,
                "the queue to drain",
            )
            listeners = int(
                new.value(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND query LIKE 'LISTEN %%'"
                )
            )
            restarts = sup.restarts
    finally:
        for p in producers:
            if p.poll() is None:
                p.kill()
    committed = _committed(logs)
    ledger = _ledger_keys(ctx)
    in_messages = message_keys(new)
    new.close()
    lost = committed - orders
    without_message = orders - in_messages
    without_row = in_messages - orders
    not_run = orders - ledger
    ran_but_lost = ledger - orders
    c = counts(ctx.db)
    errors = sum(s.get("errors", 0) for s in stats)
    outage = max((s.get("outage_s", 0.0) for s in stats), default=0.0)
    consistent = not without_message and not without_row and not not_run
    ok = (
        consistent and restarts == 0 and (not lost or not synchronous) and len(killed) > 1 and relay_ok
        and not failed
    )  # fmt: skip
    return Result(
        label,
        len(orders),
        len(lost),
        c.duplicates,
        f"first ack {first_ack:.2f} s after the promoted standby accepted writes "
        f"(primary killed -> standby promoted: {up - killed_at:.1f} s)",
        f"{len(committed)} commits seen by {PRODUCERS} producers, {len(orders)} on the new primary "
        f"({len(lost)} lost); business rows without a message: {len(without_message)}, messages "
        f"without a business row: {len(without_row)}, not run: {len(not_run)}; ran although the "
        f"failover lost their transaction: {len(ran_but_lost)}; {len(killed)} server processes killed; "
        f"producers retried {errors} transactions (longest outage {outage:.1f} s); "
        f"producers that failed: {failed} (see producer-failover.log); "
        f"LISTEN connections on the new primary: {listeners}; the periodic job ran again "
        f"{first_tick:.1f} s after the first ack; {relay_note}; worker restarts: {restarts}",
        ok,
        {
            "first_ack_s": first_ack,
            "promote_s": up - killed_at,
            "committed": len(committed),
            "lost": len(lost),
            "duplicates": c.duplicates,
            "ran_but_lost": len(ran_but_lost),
            "listeners": listeners,
            "first_tick_s": first_tick,
        },
    )


def failover_synchronous(ctx: Context) -> Result:
    """Scenario 13: the primary dies; its synchronous standby is promoted."""
    return _failover(ctx, synchronous=True)


def failover_asynchronous(ctx: Context) -> Result:
    """Scenario 14: the primary dies; its asynchronous standby is promoted."""
    return _failover(ctx, synchronous=False)


__all__ = ["failover_asynchronous", "failover_synchronous", "message_keys", "multi_host_url"]
