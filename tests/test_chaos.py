"""Fast versions of the chaos suite (``python -m benchmarks.chaos``), scenarios 1, 2, 4, 5 and 7.

Real ``dramatiq`` CLI worker processes (tests/worker_app.py) against a real
PostgreSQL, real signals, a supervisor that restarts a CLI that exited (as
systemd or Kubernetes would: Dramatiq's CLI does not respawn a dead worker
process, it stops its other workers and exits).  Liveness settings are the
short ones of worker_app.py (heartbeat_timeout 1 s, rescue every 0.3 s).

Run as ``python -m tests.test_chaos produce ...``, this module is also the
producer process of the producer-failure test.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from dramatiq import Message

from tests.helpers import LISTENERS, Supervisor, count, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


STILL_HELD = "SELECT count(*) FROM dramatiq.messages WHERE id = ANY(%s) AND owner = %s"


def held_by(db: Any, worker_ids: list[Any]) -> dict[int, str]:
    """{row id: key} of the processing rows these workers hold."""
    rows = db.execute(
        "SELECT id, payload FROM dramatiq.messages WHERE state = 'processing' AND owner = ANY(%s)",
        (worker_ids,),
    ).fetchall()
    return {row_id: str(Message.decode(bytes(payload)).args[0]) for row_id, payload in rows}


def test_worker_processes_killed_9_repeatedly_lose_nothing_and_only_in_flight_messages_run_twice(
    producer: Any, worker_process: Any, db: Any
) -> None:
    # Given 400 messages and two supervised "hosts"
    keys = [f"k{i}" for i in range(400)]
    for key in keys:
        producer.slow_record.send(key, 0.05)
    # Kills are what this test is about, not quarantine: a message in flight at every kill must not be
    # quarantined, so max_deliveries is above the number of kills.
    env = {"DPO_MAX_DELIVERIES": "10"}
    hosts = [
        Supervisor(worker_process, processes=2, threads=4, env=env),
        Supervisor(worker_process, processes=1, threads=4, env=env),
    ]
    wait_for(lambda: count(db, "SELECT count(*) FROM received") >= 20, 30, "work to start")
    # When a worker process is killed -9 three times, alternating hosts
    in_flight: set[str] = set()
    recoveries = []
    for i in range(3):
        host = hosts[i % 2]
        workers = host.workers(db)
        victim = random.choice(list(workers))
        os.kill(victim, signal.SIGKILL)
        held = held_by(db, [workers[victim]])
        in_flight |= set(held.values())
        recoveries.append(
            wait_for(
                lambda h=held, w=workers[victim]: count(db, STILL_HELD, (list(h), w)) == 0,
                15,
                "the killed worker's messages to be released",
            )
        )
    # Then every key is processed; only messages the killed processes held may run twice
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == len(keys), 60, "every key")
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the queue to drain")
    twice = {r[0] for r in db.execute("SELECT key FROM received WHERE n > 1")}
    assert twice <= in_flight
    assert max(recoveries) < 10  # heartbeat_timeout 1 s + rescue pass, with margin for a loaded machine
    assert all(h.restarts >= 1 for h in hosts)
    for host in hosts:
        host.stop()


def test_a_rolling_sigterm_restart_loses_nothing_runs_nothing_twice_and_charges_no_attempt(
    producer: Any, worker_process: Any, db: Any
) -> None:
    keys = [f"t{i}" for i in range(200)]
    for key in keys:
        producer.slow_record.send(key, 0.05)
    hosts = [Supervisor(worker_process, processes=1, threads=4) for _ in range(2)]
    wait_for(lambda: count(db, "SELECT count(*) FROM received") >= 30, 30, "work to start")
    # When each host in turn gets SIGTERM (a rolling deploy) and is started again
    for n, host in enumerate(hosts):
        workers = host.workers(db)
        # (with fresh work of 1 s per message, about 5 s for the two hosts' 8 threads, so that it
        # still holds messages when the signal comes, however slow or fast the machine is)
        host.pause()
        batch = [f"t{n}-{i}" for i in range(40)]
        for key in batch:
            producer.slow_record.send(key, 1.0)
        keys += batch
        wait_for(lambda w=workers: bool(held_by(db, list(w.values()))), 30, "the host to hold messages")
        assert held_by(db, list(workers.values())), "the host held no message when stopped"
        assert host.current.stop(signal.SIGTERM) == 0
        # Then its unstarted messages are back in the queue by the time it has exited
        assert held_by(db, list(workers.values())) == {}
        hosts[n] = Supervisor(worker_process, processes=1, threads=4)
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == len(keys), 60, "every key")
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the queue to drain")
    assert count(db, "SELECT count(*) FROM received WHERE n > 1") == 0
    # No attempt was charged for the handed-back messages.
    assert count(db, "SELECT max(attempts) FROM dramatiq.history") == 1
    for host in hosts:
        assert host.stop() == 0


def test_workers_recover_from_killed_connections_without_a_restart_and_notify_wakes_them_again(
    producer: Any, worker_process: Any, db: Any
) -> None:
    # Idle consumers poll only every 30 s: a quick pick-up at the end can only come from NOTIFY.
    host = Supervisor(worker_process, processes=2, threads=4, env={"DPO_MAX_FETCH_INTERVAL": "30000"})
    keys = [f"c{i}" for i in range(300)]
    for key in keys[:100]:
        producer.slow_record.send(key, 0.01)
    wait_for(lambda: count(db, "SELECT count(*) FROM received") >= 50, 30, "work to start")
    wait_for(
        lambda: count(db, LISTENERS) == 2,
        20,
        "both worker processes to LISTEN",
    )
    # When every connection the workers' brokers hold (pools and LISTEN) is terminated
    producer.broker.close()
    killed = count(
        db,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
        "AND query NOT LIKE 'INSERT INTO received%%' AND query NOT LIKE 'INSERT INTO started%%'",
    )
    assert killed >= 4
    for key in keys[100:]:
        producer.slow_record.send(key, 0.01)
    # Then they carry on without being restarted, and LISTEN comes back
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == len(keys), 60, "every key")
    wait_for(
        lambda: count(db, LISTENERS) == 2,
        20,
        "LISTEN to come back",
    )
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the queue to drain")
    time.sleep(1)
    started = time.monotonic()
    producer.record.send("probe")
    wait_for(lambda: count(db, "SELECT count(*) FROM received WHERE key = 'probe'") == 1, 10, "the probe")
    assert time.monotonic() - started < 3
    assert host.restarts == 0
    assert count(db, "SELECT count(*) FROM received WHERE n > 1") == 0
    assert host.stop() == 0


def test_poison_messages_are_quarantined_after_max_deliveries_while_the_rest_of_the_queue_completes(
    producer: Any, worker_process: Any, db: Any
) -> None:
    keys = [f"ok{i}" for i in range(300)]
    for i, key in enumerate(keys):
        if i in (50, 150):
            producer.crash.send(f"poison{i}")
        producer.record.send(key)
    env = {"DPO_MAX_DELIVERIES": "3"}
    # (one thread: few messages are in flight beside a poison when it kills its process)
    hosts = [Supervisor(worker_process, processes=1, threads=1, env=env) for _ in range(2)]
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == len(keys), 60, "the ordinary messages")
    wait_for(
        lambda: (
            count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed' AND actor_name = 'crash'")
            == 2
        ),
        60,
        "the poison messages to be quarantined",
    )
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the queue to drain")
    failed = db.execute(
        "SELECT actor_name, attempts, error_type, payload FROM dramatiq.history WHERE state = 'failed'"
    ).fetchall()
    assert [row[:3] for row in failed if row[0] == "crash"] == [("crash", 3, "MaxDeliveriesExceeded")] * 2
    # A delivery is charged at the claim, before the actor runs, so a message in flight in a process
    # that a poison killed is charged too: an ordinary message caught in max_deliveries such crashes
    # is quarantined as well.  It had run (its ack was lost with the process): nothing is lost.
    bystanders = [row for row in failed if row[0] != "crash"]
    assert all(row[:3] == ("record", 3, "MaxDeliveriesExceeded") for row in bystanders), bystanders
    assert {str(Message.decode(bytes(row[3])).args[0]) for row in bystanders} <= set(keys)
    # Each ran at most max_deliveries times: a claim is charged even if the other poison killed the
    # process before this one started.
    runs = dict(db.execute("SELECT key, count(*) FROM started GROUP BY key").fetchall())
    assert set(runs) == {"poison50", "poison150"} and all(1 <= n <= 3 for n in runs.values())
    assert sum(h.restarts for h in hosts) >= 3
    for host in hosts:
        host.stop()


def test_a_message_exists_exactly_when_its_producers_transaction_commits(
    database_url: str, worker_process: Any, db: Any, tmp_path: Path
) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS orders (key text PRIMARY KEY); TRUNCATE orders")
    host = Supervisor(worker_process, processes=1, threads=4)
    # Given producers that roll back a quarter of their transactions and are killed -9 at random
    # moments after their first commit (each says so by creating its file: starting one takes
    # about a second on a loaded machine, so a kill after a fixed delay often came before it)
    env = {**os.environ, "DPO_TEST_URL": database_url}
    producers = []
    try:
        for i in range(4):
            ready = tmp_path / f"p{i}.committed"
            command = [sys.executable, "-m", "tests.test_chaos", "produce", f"p{i}-", "150", str(ready)]
            producers.append((subprocess.Popen(command, cwd=ROOT, env=env), ready))
        for proc, ready in producers:
            wait_for(
                lambda r=ready, p=proc: r.exists() or p.poll() is not None, 60, "a producer's first commit"
            )
            assert ready.exists(), f"producer exited with {proc.returncode} before its first commit"
            time.sleep(random.uniform(0, 0.3))
            proc.kill()
    finally:
        for proc, _ in producers:
            proc.kill()
    codes = [proc.wait(30) for proc, _ in producers]
    assert -signal.SIGKILL in codes
    # Then exactly the keys whose order committed are processed, once each
    orders = {r[0] for r in db.execute("SELECT key FROM orders")}
    assert 0 < len(orders) < 600
    wait_for(lambda: count(db, "SELECT count(*) FROM received") >= len(orders), 30, "the committed keys")
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the queue to drain")
    time.sleep(0.5)
    assert {r[0] for r in db.execute("SELECT key FROM received")} == orders
    assert count(db, "SELECT count(*) FROM received WHERE n > 1") == 0
    assert count(db, "SELECT count(*) FROM dramatiq.history") == len(orders)
    assert host.stop() == 0


def test_a_worker_process_is_registered_before_it_claims_anything(broker: Any, db: Any) -> None:
    # A rescue pass (in any other process) takes the claims of an owner without a fresh heartbeat
    # for a dead worker's: if the first heartbeat came after the first claim, a starting worker's
    # messages were handed to others while it ran them (duplicates at every start or deploy).
    broker.declare_queue("q")
    consumer = broker.consume("q", prefetch=1, timeout=100)
    try:
        worker_id = broker.runtime.worker_id
        assert count(db, "SELECT count(*) FROM dramatiq.workers WHERE id = %s", (worker_id,)) == 1
    finally:
        consumer.close()


def produce(prefix: str, n: int, committed: str) -> None:
    """Producer process: one order row + one message per transaction; 25 % rolled back on purpose.

    Creates the file ``committed`` once its first transaction has committed.
    """
    from sqlalchemy import create_engine, text

    from dramatiq_pg_outbox import outbox
    from tests import worker_app

    url = os.environ["DPO_TEST_URL"]
    engine = create_engine("postgresql+psycopg://" + url.split("://", 1)[1])
    for i in range(n):
        key = f"{prefix}{i}"
        with engine.connect() as conn:
            with outbox(conn, worker_app.broker):
                conn.execute(text("INSERT INTO orders (key) VALUES (:key)"), {"key": key})
                worker_app.record.send(key)
            time.sleep(random.uniform(0, 0.02))  # open transaction: a kill often lands here
            if random.random() < 0.25:
                conn.rollback()
            else:
                conn.commit()
                if not os.path.exists(committed):
                    Path(committed).touch()


if __name__ == "__main__" and sys.argv[1:2] == ["produce"]:
    produce(sys.argv[2], int(sys.argv[3]), sys.argv[4])
