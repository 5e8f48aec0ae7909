"""Behaviour that is about processes: real `dramatiq` CLI workers, kill -9, SIGTERM, killed connections."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests.helpers import LISTENERS, count, wait_for

pytestmark = pytest.mark.slow


def test_two_worker_processes_never_receive_the_same_message_and_together_receive_all(
    producer: Any, worker_process: Any, db: Any
) -> None:
    keys = [f"k{i}" for i in range(2_000)]
    for key in keys:
        producer.record.send(key)
    a = worker_process(threads=4)
    b = worker_process(threads=4)
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == len(keys), 90, "all keys")
    assert a.stop() == 0 and b.stop() == 0
    assert count(db, "SELECT count(*) FROM received WHERE n > 1") == 0
    # Both processes took part.
    assert count(db, "SELECT count(DISTINCT pids[1]) FROM received") == 2
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'completed'") == len(keys)


def test_a_killed_workers_messages_are_delivered_again(producer: Any, worker_process: Any, db: Any) -> None:
    # Given a worker busy with slow messages
    for i in range(4):
        producer.slow_record.send(f"s{i}", 30)
    victim = worker_process(threads=4)
    wait_for(lambda: count(db, "SELECT count(*) FROM started") == 4, 30, "slow messages to start")
    # When it is killed -9 and another worker runs
    victim.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE state = 'processing'") == 4
    rescuer = worker_process(threads=4)
    # Then its messages start again elsewhere within the heartbeat timeout (1 s here) plus a rescue pass
    wait_for(lambda: count(db, "SELECT count(*) FROM started") == 8, 30, "redelivery")
    assert time.monotonic() - killed_at < 15
    rows = db.execute("SELECT attempts FROM dramatiq.messages WHERE state = 'processing'").fetchall()
    assert rows == [(2,)] * 4
    rescuer.stop(signal.SIGKILL)


def failed(db: Any) -> int:
    """Dead letters in history."""
    return count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'")


def test_a_message_that_kills_its_worker_is_quarantined_after_max_deliveries(
    producer: Any, worker_process: Any, db: Any
) -> None:
    # Given a poison message among ordinary ones, and max_deliveries=3
    producer.crash.send("poison")
    for i in range(50):
        producer.record.send(f"ok{i}")
    # When workers keep being restarted by a supervisor each time the poison kills them
    restarts = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        wp = worker_process(threads=2, env={"DPO_MAX_DELIVERIES": "3"})
        wait_for(
            lambda wp=wp: wp.proc.poll() is not None or failed(db) == 1,
            max(0.0, deadline - time.monotonic()),
            "the poison to kill its worker or to be failed",
            0.1,
        )
        if wp.proc.poll() is None:
            wp.stop()
            break
        restarts += 1
    # Then it ran exactly max_deliveries times and sits in history as failed; the rest completed
    assert count(db, "SELECT count(*) FROM started WHERE key = 'poison'") == 3
    ((state, attempts, error_type),) = db.execute(
        "SELECT state, attempts, error_type FROM dramatiq.history WHERE message_id IN "
        "(SELECT message_id FROM dramatiq.history WHERE actor_name = 'crash')"
    ).fetchall()
    assert (state, attempts, error_type) == ("failed", 3, "MaxDeliveriesExceeded")
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == 50, 30, "ordinary messages")
    assert restarts >= 3


def test_the_worker_recovers_after_its_connections_are_terminated(
    producer: Any, worker_process: Any, db: Any, database_url: str
) -> None:
    wp = worker_process(threads=4)
    for i in range(100):
        producer.record.send(f"a{i}")
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == 100, 30, "first batch")
    # When every connection of the worker (pool and LISTEN) is terminated
    own = db.execute("SELECT pg_backend_pid()").fetchone()[0]
    # (pg_terminate_backend in the select list: it runs only for the rows the WHERE clause kept.
    # In the WHERE clause the planner may call it before the other conditions, on every
    # backend of the server: that killed the connections of other test runs.)
    victims = [
        pid
        for pid, terminated in db.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> %s AND backend_type = 'client backend'",
            (own,),
        )
        if terminated
    ]
    assert len(victims) >= 2
    wait_for(
        lambda: (
            count(db, f"SELECT count(*) FROM pg_stat_activity WHERE pid IN ({','.join(map(str, victims))})")
            == 0
        ),
        10,
        "terminated backends to exit",
    )
    # Then, without a restart, it processes new messages and LISTEN works again
    for i in range(100):
        producer.record.send(f"b{i}")
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == 200, 60, "second batch")
    wait_for(
        lambda: count(db, LISTENERS) >= 1,
        30,
        "LISTEN connection to come back",
    )
    assert wp.proc.poll() is None
    assert wp.stop() == 0
    assert count(db, "SELECT count(*) FROM received WHERE n > 1") == 0


def test_sigterm_requeues_unstarted_messages_without_an_attempt(
    producer: Any, worker_process: Any, db: Any
) -> None:
    for i in range(40):
        producer.slow_record.send(f"t{i}", 1)
    wp = worker_process(threads=2)
    wait_for(lambda: count(db, "SELECT count(*) FROM started") >= 2, 30, "work to start")
    assert wp.stop(signal.SIGTERM) == 0
    rows = db.execute("SELECT state, attempts FROM dramatiq.messages").fetchall()
    assert rows and all(row == ("pending", 0) for row in rows)
    assert len(rows) + count(db, "SELECT count(*) FROM received") == 40


def test_worker_processes_use_the_documented_connection_budget(
    producer: Any, worker_process: Any, db: Any
) -> None:
    # docs/guides/configuration.md, "Connection budget": pool_size (4) + 1 LISTEN connection per worker
    # process, whatever the queues and threads.
    wp = worker_process(processes=2, threads=8)
    for i in range(500):
        producer.record.send(f"c{i}")
    wait_for(lambda: count(db, "SELECT count(*) FROM received") == 500, 60, "messages")
    pids = [r[0] for r in db.execute("SELECT pid FROM dramatiq.workers")]
    assert len(pids) == 2
    query = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'dramatiq-pg-outbox:%s'"
    )
    for pid in pids:
        pool = count(db, query % pid)
        listen = count(db, query % f"{pid}:listen")
        assert 1 <= pool <= 4 and listen == 1
    wp.stop()
