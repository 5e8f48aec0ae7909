"""The outbox in two-phase transactions (``Connection.begin_twophase()``, ``Session(twophase=True)``).

The shared server runs with ``max_prepared_transactions = 0``; these tests start a
throwaway server that allows prepared transactions.  PostgreSQL refuses to PREPARE a
transaction that ran NOTIFY, so the messages are written before the PREPARE and the
wake-up is sent after the second phase, from the broker's own connection.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox, upgrade
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.testing import ThrowawayPostgres

from .helpers import wait_for


@pytest.fixture(scope="module")
def twophase_url() -> Iterator[str]:
    try:
        server = ThrowawayPostgres({"max_prepared_transactions": 10})
    except RuntimeError as e:
        pytest.skip(f"cannot start a PostgreSQL server that allows prepared transactions: {e}")
    with server:
        url = server.url_for("postgres")
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE accounts (id serial PRIMARY KEY, name text NOT NULL)")
        yield url


@pytest.fixture
def db2(twophase_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(twophase_url, autocommit=True) as conn:
        conn.execute("TRUNCATE dramatiq.messages, dramatiq.history, accounts")
        yield conn


@pytest.fixture
def broker2(twophase_url: str, db2: Any) -> Iterator[PostgresBroker]:
    broker = PostgresBroker(url=twophase_url, max_fetch_interval=200)
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


@pytest.fixture
def engine2(twophase_url: str) -> Iterator[Any]:
    engine = create_engine(normalize_sqlalchemy_url(twophase_url))
    yield engine
    engine.dispose()


@pytest.fixture
def welcome(broker2: PostgresBroker) -> Any:
    @dramatiq.actor(broker=broker2)
    def welcome(name: str) -> None: ...

    return welcome


@pytest.fixture
def listener(twophase_url: str, broker2: PostgresBroker) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(twophase_url, autocommit=True) as conn:
        conn.execute(f'LISTEN "{broker2.channel}"')
        yield conn


def _state(db: Any) -> tuple[list[str], list[str]]:
    messages = [r[0] for r in db.execute("SELECT actor_name FROM dramatiq.messages ORDER BY id")]
    accounts = [r[0] for r in db.execute("SELECT name FROM accounts ORDER BY id")]
    return messages, accounts


def _notified(conn: psycopg.Connection[Any], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    payloads: list[str] = []
    while time.monotonic() < deadline and not payloads:
        payloads += [n.payload for n in conn.notifies(timeout=0.1, stop_after=1)]
    return payloads


def test_a_prepared_then_committed_connection_transaction_stores_its_message(
    db2: Any, welcome: Any, engine2: Any, listener: Any
) -> None:
    with engine2.connect() as conn:
        # Given a two-phase transaction with a business row and a message
        trans = conn.begin_twophase(xid=f"dpo-{uuid.uuid4().hex}")
        with outbox(conn):
            conn.execute(text("INSERT INTO accounts (name) VALUES ('ada')"))
            welcome.send("ada")
        # When it is prepared: the message is written but not visible yet
        trans.prepare()
        assert _state(db2) == ([], [])
        # Then after the second phase both are there, and the workers are woken
        trans.commit()
    assert _state(db2) == (["welcome"], ["ada"])
    assert _notified(listener, 5) == [welcome.queue_name]


def test_a_prepared_then_rolled_back_connection_transaction_leaves_no_message(
    db2: Any, welcome: Any, engine2: Any
) -> None:
    with engine2.connect() as conn:
        trans = conn.begin_twophase(xid=f"dpo-{uuid.uuid4().hex}")
        with outbox(conn):
            conn.execute(text("INSERT INTO accounts (name) VALUES ('bob')"))
            welcome.send("bob")
        trans.prepare()
        trans.rollback()
    assert _state(db2) == ([], [])
    # And nothing left behind for the next transaction of the pooled connection
    with engine2.connect() as conn:
        with outbox(conn):
            welcome.send("carol")
        conn.commit()
    assert _state(db2) == (["welcome"], [])


def test_a_two_phase_transaction_committed_without_prepare_stores_its_message(
    db2: Any, welcome: Any, engine2: Any
) -> None:
    with engine2.connect() as conn:
        trans = conn.begin_twophase(xid=f"dpo-{uuid.uuid4().hex}")
        with outbox(conn):
            conn.execute(text("INSERT INTO accounts (name) VALUES ('dan')"))
            welcome.send("dan")
        trans.commit()
    assert _state(db2) == (["welcome"], ["dan"])


def test_a_two_phase_session_commits_with_its_message_and_a_worker_runs_it(
    db2: Any, broker2: PostgresBroker, engine2: Any, listener: Any
) -> None:
    ran: list[str] = []

    @dramatiq.actor(broker=broker2)
    def welcome(name: str) -> None:
        ran.append(name)

    # Given a Session(twophase=True): its commit prepares, then commits prepared
    with Session(engine2, twophase=True) as session:
        with outbox(session):
            session.execute(text("INSERT INTO accounts (name) VALUES ('eve')"))
            welcome.send("eve")
        session.commit()
    assert _state(db2) == (["welcome"], ["eve"])
    assert _notified(listener, 5) == [welcome.queue_name]
    # And a rolled-back one stores nothing
    with Session(engine2, twophase=True) as session:
        with outbox(session):
            session.execute(text("INSERT INTO accounts (name) VALUES ('frank')"))
            welcome.send("frank")
        session.rollback()
    assert _state(db2) == (["welcome"], ["eve"])
    worker = dramatiq.Worker(broker2, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        wait_for(lambda: ran == ["eve"], 10, "the message ran")
    finally:
        worker.stop()
