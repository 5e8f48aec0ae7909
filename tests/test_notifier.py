"""The after-commit wake-up written by the committing thread on the notifier's connection."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from typing import Any

import dramatiq
import psycopg
import pytest
from sqlalchemy import create_engine, event
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import outbox
from dramatiq_pg_outbox._runtime.notifier import Notifier
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.store.libpq import text_array

from .helpers import ISOLATION_LEVELS, wait_for, with_url_default

ALIVE = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"


@pytest.fixture
def engine(database_url: str) -> Any:
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    yield engine
    engine.dispose()


def warm_after_commit_broker(make_broker: Any, engine: Any, url: str | None = None) -> Any:
    """An after-commit broker whose flush thread opened the notifier's connection, and an actor."""
    broker = make_broker(url, notify="after_commit")

    @dramatiq.actor(broker=broker, queue_name="q0")
    def task() -> None:
        pass

    with Session(engine) as session:
        with outbox(session, broker):
            task.send()
        session.rollback()
    flusher = broker.runtime.flusher
    assert flusher.warmed.wait(5.0), "the flush thread did not warm up"
    return broker, task


@pytest.mark.parametrize(
    "values",
    [
        ["default"],
        ["a", "b.DQ", "c@1700000000000"],
        ['quo"te', "back\\slash", "{brace},comma", "", "NULL", "é 日本"],
    ],
)
def test_the_text_form_of_the_payloads_reads_back_as_the_same_array(db: Any, values: list[str]) -> None:
    (read,) = db.execute("SELECT %s::text[]", [text_array(values)]).fetchone()
    assert read == values


def test_one_statement_is_in_flight_at_a_time_and_a_refused_one_is_given_back(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute('LISTEN "wake"')
        notifier = Notifier(database_url, "wake", {"autocommit": True})
        notifier.open()
        try:
            # Given a NOTIFY written and its reply not read yet
            assert notifier.send(["a", "b"])
            # When another is sent
            second = notifier.send(["c"])
            # Then it is refused (the caller sends it another way), and the first arrives
            assert not second
            assert notifier.collect(5.0) == []
            assert notifier.send(["d"])
            assert notifier.collect(5.0) == []
            notes = [n.payload for n in listener.notifies(timeout=2.0, stop_after=3)]
            assert notes == ["a", "b", "d"]
            # When the server refuses one (a payload over NOTIFY's 8000 bytes)
            assert notifier.send(["x" * 9000])
            # Then collect gives its payloads back, and the connection takes the next one
            assert notifier.collect(5.0) == ["x" * 9000]
            assert notifier.send(["e"])
            assert notifier.collect(5.0) == []
            assert [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)] == ["e"]
        finally:
            notifier.close()
    assert not notifier.send(["closed"])


def test_a_session_commit_writes_its_wake_up_without_the_flush_thread(
    database_url: str, make_broker: Any, engine: Any
) -> None:
    broker, task = warm_after_commit_broker(make_broker, engine)
    flusher = broker.runtime.flusher
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        # Given the flush thread held up (a long flush pass)
        with flusher._flush_lock:
            # When a Session commits one message
            with Session(engine) as session:
                with outbox(session, broker):
                    task.send()
                session.commit()
            # Then its wake-up arrives while the flush thread is still held up
            notes = [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)]
            assert notes == ["q0"]
    # And the flush thread reads the reply once it runs again
    notifier = flusher.notifier
    assert notifier is not None
    wait_for(lambda: notifier._sent is None, 5.0, "the reply read")


def test_a_connection_commit_writes_its_wake_up_once_the_commit_returned(
    database_url: str, make_broker: Any, engine: Any
) -> None:
    broker, task = warm_after_commit_broker(make_broker, engine)
    flusher = broker.runtime.flusher
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        # Given the flush thread held up (a long flush pass)
        with flusher._flush_lock:
            # When a Connection commits one message
            with engine.connect() as conn:
                with outbox(conn, broker):
                    task.send()
                conn.commit()
            # Then its wake-up arrives while the flush thread is still held up
            notes = [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)]
            assert notes == ["q0"]
    # And the transaction ran no statement for the wake-up (its transaction id is not needed)
    assert any("INSERT" in s for s in statements)
    assert not [s for s in statements if "xact" in s], statements


def test_wake_ups_go_through_the_pool_while_the_notifier_connection_is_broken(
    database_url: str, make_broker: Any, engine: Any, db: Any
) -> None:
    broker, task = warm_after_commit_broker(make_broker, engine)
    notifier = broker.runtime.flusher.notifier
    assert notifier is not None and notifier.connected
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        for _ in range(2):
            # Given the notifier's connection ended by the server
            pid = notifier.backend_pid
            db.execute("SELECT pg_terminate_backend(%s)", [pid])
            wait_for(lambda pid=pid: not db.execute(ALIVE, [pid]).fetchall(), 5.0, "the backend gone")
            # When a Session commits one message
            with Session(engine) as session:
                with outbox(session, broker):
                    task.send()
                session.commit()
            # Then its wake-up arrives, and the notifier has a new connection
            assert [n.payload for n in listener.notifies(timeout=5.0, stop_after=1)] == ["q0"]
            wait_for(lambda pid=pid: notifier.backend_pid not in (None, pid), 5.0, "a new connection")
        # And the next commit's wake-up is written on it
        sent = notifier.sent
        with Session(engine) as session:
            with outbox(session, broker):
                task.send()
            session.commit()
        assert [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)] == ["q0"]
        assert notifier.sent == sent + 1


@pytest.mark.parametrize("isolation", ISOLATION_LEVELS)
def test_no_wake_up_is_lost_to_concurrent_commits_and_a_killed_connection(
    database_url: str, make_broker: Any, db: Any, isolation: str
) -> None:
    """Eight threads commit in turn on queues of their own, each waiting for its wake-up before
    its next commit, while the notifier's connection is terminated at random times: every commit's
    wake-up arrives (written by the committing thread, by the flush thread, or sent again)."""
    url = with_url_default(database_url, isolation)
    engine = create_engine(normalize_sqlalchemy_url(url))
    try:
        broker, _ = warm_after_commit_broker(make_broker, engine, url)
        threads_n, commits = 8, 40
        actors = [
            dramatiq.actor(lambda: None, broker=broker, actor_name=f"t{i}", queue_name=f"q{i}")
            for i in range(threads_n)
        ]
        notifier = broker.runtime.flusher.notifier
        assert notifier is not None
        received: dict[str, int] = defaultdict(int)
        arrived = threading.Condition()
        failures: list[str] = []
        done = threading.Event()

        def listen() -> None:
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(f'LISTEN "{broker.channel}"')
                listening.set()
                while not done.is_set():
                    for note in conn.notifies(timeout=0.1):
                        with arrived:
                            received[note.payload] += 1
                            arrived.notify_all()

        def commit_in_turn(i: int) -> None:
            queue = f"q{i}"
            for n in range(commits):
                with arrived:
                    seen = received[queue]
                with Session(engine) as session:
                    with outbox(session, broker):
                        actors[i].send()
                    session.commit()
                with arrived:
                    if not arrived.wait_for(lambda seen=seen: received[queue] > seen, timeout=5.0):
                        failures.append(f"{queue}: no wake-up for commit {n}")
                        return

        def kill() -> None:
            rng = random.Random(isolation)
            while not done.is_set():
                time.sleep(rng.uniform(0.01, 0.05))
                pid = notifier.backend_pid
                if pid is not None:
                    db.execute("SELECT pg_terminate_backend(%s)", [pid])
                    kills.append(pid)

        listening = threading.Event()
        kills: list[int] = []
        listener = threading.Thread(target=listen)
        listener.start()
        assert listening.wait(5.0)
        killer = threading.Thread(target=kill)
        killer.start()
        workers = [threading.Thread(target=commit_in_turn, args=(i,)) for i in range(threads_n)]
        sent = notifier.sent
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        done.set()
        killer.join(5)
        listener.join(5)
        assert failures == []
        assert all(received[f"q{i}"] >= commits for i in range(threads_n)), dict(received)
        # Both ways were taken: written at once by a committing thread, and after kills.
        assert notifier.sent > sent
        assert len(kills) >= 3
    finally:
        engine.dispose()
