"""Concurrency keys: at most N messages of a key processing at a time, enforced by the claim
(migration 0021, docs/guides/concurrency.md), across real worker processes."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest

from benchmarks.chaos.harness import gone
from dramatiq_pg_outbox import PostgresBroker

from .helpers import Supervisor, count, wait_for

SPANS = (
    "CREATE TABLE IF NOT EXISTS spans (id bigserial PRIMARY KEY, grp text NOT NULL, pid int NOT NULL,"
    " started timestamptz NOT NULL, ended timestamptz); TRUNCATE spans;"
)


@pytest.fixture
def spans(db: Any) -> Iterator[Any]:
    db.execute(SPANS)
    db.execute("DELETE FROM dramatiq.concurrency_limits")
    yield db
    db.execute("DELETE FROM dramatiq.concurrency_limits")


def most_at_once(rows: list[tuple[dt.datetime, dt.datetime]]) -> int:
    """The largest number of the intervals ``(start, end)`` that overlap at one instant."""
    events = sorted(
        [(start, 1) for start, _ in rows] + [(end, -1) for _, end in rows], key=lambda e: (e[0], e[1])
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def peaks(db: Any) -> dict[str, int]:
    rows = db.execute("SELECT grp, started, ended FROM spans WHERE ended IS NOT NULL ORDER BY grp").fetchall()
    by_group: dict[str, list[tuple[dt.datetime, dt.datetime]]] = {}
    for group, started, ended in rows:
        by_group.setdefault(group, []).append((started, ended))
    return {group: most_at_once(spans) for group, spans in by_group.items()}


def test_most_at_once_counts_overlaps() -> None:
    t = dt.datetime(2026, 1, 1)
    s = dt.timedelta(seconds=1)
    assert most_at_once([(t, t + s), (t + s, t + 2 * s)]) == 1  # one ends as the next starts
    assert most_at_once([(t, t + 2 * s), (t + s, t + 3 * s), (t + s, t + 2 * s)]) == 3


def test_the_limit_of_each_key_holds_across_worker_processes(
    worker_process: Any, producer: Any, spans: Any
) -> None:
    # Given 3 keys with limits 1, 2 and 3, 12 messages each, and unkeyed messages in the same queue
    span = producer.span
    for _ in range(12):
        for key, limit in (("a", 1), ("b", 2), ("c", 3)):
            span.send_with_options(args=(key, 0.1), concurrency_key=f"test:{key}", concurrency_limit=limit)
    for _ in range(12):
        span.send("free", 0.1)
    # When two worker processes of 6 threads each (12 at once) run them
    workers = [worker_process(processes=1, threads=6) for _ in range(2)]
    try:
        ended = "SELECT count(*) FROM spans WHERE ended IS NOT NULL"
        wait_for(lambda: spans.execute(ended).fetchone()[0] == 48, 60, "every message to run")
    finally:
        for worker in workers:
            worker.stop()
    # Then no key ever had more messages running than its limit, and each reached it
    found = peaks(spans)
    assert found["a"] == 1 and found["b"] == 2 and found["c"] == 3, found
    # While the unkeyed messages were not held back by the keys' limits
    assert found["free"] >= 4, found
    # And both processes ran keyed messages
    assert spans.execute("SELECT count(DISTINCT pid) FROM spans WHERE grp <> 'free'").fetchone()[0] == 2
    assert (
        spans.execute("SELECT count(*) FROM dramatiq.history WHERE state = 'completed'").fetchone()[0] == 48
    )


def test_the_limit_of_each_key_holds_when_a_worker_process_is_killed_9_mid_run(
    worker_process: Any, producer: Any, spans: Any
) -> None:
    # Given 3 keys with limits 1, 2 and 3, 10 messages each of 0.4 s, and unkeyed messages
    limits = {"a": 1, "b": 2, "c": 3}
    for _ in range(10):
        for key, limit in limits.items():
            producer.span.send_with_options(
                args=(key, 0.4), concurrency_key=f"kill:{key}", concurrency_limit=limit
            )
        producer.span.send("free", 0.4)
    total = 40
    # And two supervised worker processes (the CLI of a killed one exits and is started again)
    hosts = [Supervisor(worker_process, processes=1, threads=4) for _ in range(2)]
    victim = next(iter(hosts[0].workers(spans)))
    # When one of them is killed -9 while it runs keyed messages
    running = "SELECT count(*) FROM spans WHERE pid = %s AND ended IS NULL AND grp <> 'free'"
    wait_for(lambda: count(spans, running, (victim,)) > 0, 30, "the victim to run a keyed message")
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: gone(victim), 10, "the killed process to die", interval=0.01)
    # (the database's clock once it is dead: the actors died with it, no later)
    killed_at = spans.execute("SELECT clock_timestamp()").fetchone()[0]
    # Then every message completes, the killed ones on the other process or the restarted one
    completed = "SELECT count(*) FROM dramatiq.history WHERE state = 'completed'"
    wait_for(lambda: count(spans, completed) == total, 60, "every message to complete")
    wait_for(lambda: count(spans, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the queue to drain")
    for host in hosts:
        host.stop()
    rows = spans.execute("SELECT grp, pid, started, ended FROM spans").fetchall()
    # And the only deliveries without an end are the killed process's (re-run since)
    cut = [row for row in rows if row[3] is None]
    assert cut and {row[1] for row in cut} == {victim}, cut
    assert hosts[0].restarts == 1
    by_group: dict[str, list[tuple[dt.datetime, dt.datetime]]] = {}
    for group, _pid, started, ended in rows:
        by_group.setdefault(group, []).append((started, max(started, killed_at) if ended is None else ended))
    ended_per_group = {g: sum(1 for row in rows if row[0] == g and row[3] is not None) for g in by_group}
    assert all(n >= 10 for n in ended_per_group.values()), ended_per_group
    # And no key ever had more running than its limit, a killed delivery's interval ending at the kill
    found = {group: most_at_once(intervals) for group, intervals in by_group.items()}
    assert all(found[key] <= limit for key, limit in limits.items()), found
    assert found["a"] == 1 and found["c"] >= 2, found


def test_a_message_held_by_its_key_is_not_charged_an_attempt_and_a_run_time_limit_wins(
    broker: PostgresBroker, start_worker: Any, spans: Any, database_url: str
) -> None:
    import threading

    release = threading.Event()
    ran: list[int] = []

    @dramatiq.actor(broker=broker, concurrency_key=lambda i: "account:7", max_retries=0)
    def sync(i: int) -> None:
        ran.append(i)
        release.wait(20)

    for i in range(4):
        sync.send(i)
    start_worker(broker, worker_threads=4)
    # The key's default limit is 1: one runs, the others wait pending, with no attempt charged
    wait_for(lambda: len(ran) == 1, 10, "the first message to start")
    time.sleep(0.5)
    assert ran == [0]
    states = spans.execute("SELECT state, attempts FROM dramatiq.messages ORDER BY id").fetchall()
    assert states == [("processing", 1), ("pending", 0), ("pending", 0), ("pending", 0)]
    # When an operator raises the key's limit at run time (its prefix), two more start at once
    from dramatiq_pg_outbox.cli import main

    assert main(["limits", "set", "account:", "3", "--url", database_url]) == 0
    release.set()  # (the running one ends too, freeing a slot and waking the consumers)
    wait_for(lambda: len(ran) == 4, 10, "every message to run")
    assert ran == [0, 1, 2, 3]  # FIFO within a key
    # And the change is on the audit trail
    audit = "SELECT action, target, count, detail FROM dramatiq.audit WHERE action = 'limit-set' ORDER BY id"

    assert spans.execute(audit).fetchall()[-1] == ("limit-set", "account:", 3, "previous: none")


def test_the_limits_command_lists_sets_and_unsets(
    broker: PostgresBroker, spans: Any, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from dramatiq_pg_outbox.cli import main

    @dramatiq.actor(broker=broker)
    def export(i: int) -> None:
        pass

    for i in range(3):
        export.send_with_options(args=(i,), concurrency_key="customer:1", concurrency_limit=2)
    export.send_with_options(args=(9,), concurrency_key="customer:2")
    capsys.readouterr()
    assert main(["limits", "--url", database_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "no run-time limit (keys take the limits their messages carry; default 1)"
    assert lines[2].split() == ["queue", "key", "processing", "waiting", "limit", "from"]
    assert lines[3].split() == ["default", "customer:1", "0", "3", "2", "(message)"]
    assert lines[4].split() == ["default", "customer:2", "0", "1", "1", "(message)"]
    assert main(["limits", "set", "customer:", "5", "--dry-run", "--url", database_url]) == 0
    assert "would set the limit of keys 'customer:'* to 5 (now: none)" in capsys.readouterr().out
    assert main(["limits", "set", "customer:", "5", "--url", database_url]) == 0
    assert capsys.readouterr().out.strip() == (
        "set the limit of keys 'customer:'* to 5 (was: none); woke the workers of 1 queue(s)"
    )
    assert main(["limits", "--json", "--url", database_url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["queue_name"], r["prefix"], r["max_running"], r["waiting"]) for r in listed["limits"]] == [
        (None, "customer:", 5, 4)
    ]
    assert [(k["key"], k["max_running"], k["limited_by"], k["limit_queue"]) for k in listed["keys"]] == [
        ("customer:1", 5, "customer:", None), ("customer:2", 5, "customer:", None)
    ]  # fmt: skip
    # A limit of one queue: listed beside the one of every queue, and it wins for that queue's keys
    assert main(["limits", "set", "customer:1", "1", "--queue", "elsewhere", "--url", database_url]) == 0
    assert capsys.readouterr().out.strip() == (
        "set the limit of keys 'customer:1'* of queue 'elsewhere' to 1 (was: none); "
        "woke the workers of 0 queue(s)"
    )
    assert main(["limits", "set", "customer:", "2", "--queue", "default", "--url", database_url]) == 0
    assert "woke the workers of 1 queue(s)" in capsys.readouterr().out
    assert main(["limits", "--url", database_url, "--keys", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[:5]] == [
        ["queue", "prefix", "limit"], ["(every", "queue)", "customer:"], ["default", "customer:", "2"],
        ["elsewhere", "customer:1", "1"], [],
    ]  # fmt: skip
    assert lines[-1].split() == ["default", "customer:1", "0", "3", "2", "customer:*", "of", "default"]
    assert main(["limits", "--queue", "elsewhere", "--json", "--url", database_url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["queue_name"], r["prefix"]) for r in listed["limits"]] == [
        (None, "customer:"), ("elsewhere", "customer:1")
    ]  # fmt: skip
    assert listed["keys"] == []  # (no message in that queue)
    assert main(["limits", "unset", "customer:", "--queue", "default", "--url", database_url]) == 0
    assert "removed the limit 2 of keys 'customer:'* of queue 'default'" in capsys.readouterr().out
    assert main(["limits", "unset", "customer:1", "--queue", "elsewhere", "--url", database_url]) == 0
    assert main(["limits", "unset", "customer:", "--url", database_url]) == 0
    assert "removed the limit 5" in capsys.readouterr().out
    assert main(["limits", "unset", "customer:", "--url", database_url]) == 1
    assert "no run-time limit for keys 'customer:'*" in capsys.readouterr().err
    assert main(["limits", "unset", "customer:", "--queue", "default", "--url", database_url]) == 1
    assert "no run-time limit for keys 'customer:'* of queue 'default'" in capsys.readouterr().err
    # The audit trail names the queue of a queue's limit
    audit = (
        "SELECT action, target FROM dramatiq.audit WHERE target LIKE 'customer:%%' ORDER BY id DESC LIMIT 2"
    )
    assert spans.execute(audit).fetchall() == [
        ("limit-unset", "customer:"), ("limit-unset", "customer:1 in queue elsewhere")
    ]  # fmt: skip


def test_a_queues_own_limit_wins_over_the_limit_of_every_queue_and_leaves_other_queues(
    broker: PostgresBroker, start_worker: Any, spans: Any, database_url: str
) -> None:
    import threading
    import uuid

    from dramatiq_pg_outbox.cli import main

    # Given a limit of 3 for "tenant:" keys in every queue, and one of 1 in queue A only
    queue_a, queue_b = f"limits_a_{uuid.uuid4().hex[:8]}", f"limits_b_{uuid.uuid4().hex[:8]}"
    assert main(["limits", "set", "tenant:", "3", "--url", database_url]) == 0
    assert main(["limits", "set", "tenant:", "1", "--queue", queue_a, "--url", database_url]) == 0
    release = threading.Event()
    running: dict[str, int] = {queue_a: 0, queue_b: 0}
    lock = threading.Lock()

    def run(queue: str) -> None:
        with lock:
            running[queue] += 1
        release.wait(30)

    @dramatiq.actor(broker=broker, queue_name=queue_a, concurrency_key="tenant:a")
    def in_a(i: int) -> None:
        run(queue_a)

    @dramatiq.actor(broker=broker, queue_name=queue_b, concurrency_key="tenant:b")
    def in_b(i: int) -> None:
        run(queue_b)

    for i in range(4):
        in_a.send(i)
        in_b.send(i)
    start_worker(broker, worker_threads=8)
    # Then queue A's key runs one at a time, queue B's three (the limit of every queue)
    wait_for(lambda: running[queue_b] == 3 and running[queue_a] == 1, 30, "A's 1 and B's 3 to start")
    time.sleep(1)
    assert running == {queue_a: 1, queue_b: 3}
    # When A's own limit is removed, A's key takes the limit of every queue: two more start at once
    assert main(["limits", "unset", "tenant:", "--queue", queue_a, "--url", database_url]) == 0
    wait_for(lambda: running[queue_a] == 3, 30, "A's key to take the limit of every queue")
    time.sleep(1)
    assert running == {queue_a: 3, queue_b: 3}
    release.set()
    wait_for(lambda: running == {queue_a: 4, queue_b: 4}, 30, "every message to run")


def test_a_key_with_limit_zero_is_held_and_resumes_when_raised(
    broker: PostgresBroker, start_worker: Any, spans: Any
) -> None:
    ran: list[int] = []

    @dramatiq.actor(broker=broker, concurrency_key="export:1", concurrency_limit=2)
    def export(i: int) -> None:
        ran.append(i)

    spans.execute("INSERT INTO dramatiq.concurrency_limits (prefix, max_running) VALUES ('export:', 0)")
    for i in range(3):
        export.send(i)
    start_worker(broker)
    time.sleep(1)
    assert ran == []
    spans.execute("DELETE FROM dramatiq.concurrency_limits WHERE prefix = 'export:'")
    wait_for(lambda: len(ran) == 3, 10, "the held messages to run")


def test_bad_keys_and_limits_are_refused_at_send(broker: PostgresBroker, db: Any) -> None:
    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    with pytest.raises(ValueError, match="concurrency_key must be a non-empty string"):
        job.send_with_options(concurrency_key="")
    with pytest.raises(ValueError, match="concurrency_limit must be an integer >= 0, not -1"):
        job.send_with_options(concurrency_key="k", concurrency_limit=-1)
    with pytest.raises(ValueError, match="concurrency_limit needs a concurrency_key"):
        job.send_with_options(concurrency_limit=2)

    @dramatiq.actor(broker=broker, concurrency_key=lambda: 1 / 0)
    def broken() -> None:
        pass

    with pytest.raises(
        ValueError, match="the concurrency_key function of actor 'broken' raised ZeroDivisionError"
    ):
        broken.send()
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 0


def test_a_dead_letter_retried_keeps_its_key(broker: PostgresBroker, start_worker: Any, db: Any) -> None:
    @dramatiq.actor(broker=broker, max_retries=0)
    def boom() -> None:
        raise RuntimeError("boom")

    boom.send_with_options(concurrency_key="tenant:9", concurrency_limit=4)
    worker = start_worker(broker)
    wait_for(
        lambda: db.execute("SELECT count(*) FROM dramatiq.history").fetchone()[0] == 1, 10, "a dead letter"
    )
    worker.stop()
    assert db.execute("SELECT concurrency_key, concurrency_limit FROM dramatiq.history").fetchone() == (
        "tenant:9",
        4,
    )
    from dramatiq_pg_outbox.cli import main

    assert main(["retry-failed", "--url", broker.conninfo, "--queue", "default"]) == 0
    assert db.execute("SELECT concurrency_key, concurrency_limit FROM dramatiq.messages").fetchone() == (
        "tenant:9",
        4,
    )


def test_priorities_come_first_within_a_key_and_among_the_unkeyed_messages_of_a_keyed_queue(
    broker: PostgresBroker, start_worker: Any, spans: Any
) -> None:
    import threading

    release = threading.Event()
    ran: list[str] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    def job(name: str) -> None:
        ran.append(name)
        if name == "first":
            release.wait(20)

    # Given a key at limit 1 busy with its first message, four more waiting, then one of the
    # same key with a broker_priority
    job.send_with_options(args=("first",), concurrency_key="acct:1")
    worker = start_worker(broker, worker_threads=1)
    wait_for(lambda: ran == ["first"], 10, "the first message to start")
    for i in range(4):
        job.send_with_options(args=(f"old{i}",), concurrency_key="acct:1")
    job.send_with_options(args=("urgent",), concurrency_key="acct:1", broker_priority=9)
    # When the slot frees
    release.set()
    wait_for(lambda: len(ran) == 6, 15, "every message to run")
    # Then the prioritized message of the key runs before the older ones, which keep their order
    assert ran == ["first", "urgent", "old0", "old1", "old2", "old3"]
    worker.stop()
