"""One send in a Session transaction: its INSERT and the COMMIT written through libpq's pipeline.

``dramatiq_pg_outbox.store.libpq`` sends the ``enqueue_one`` statement, prepared once per
connection, and the COMMIT in one round trip.  These tests pin what psycopg's pipeline did
before: a server error, a connection that does not prepare, and psycopg's own ``DEALLOCATE
ALL`` after a rollback, which must not leave the next send without its statement (a lost
connection: ``tests/test_outbox.py -k lost``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url

STATEMENT = "dramatiq_pg_outbox_enqueue_one_%"


@pytest.fixture
def engine(database_url: str) -> Iterator[Any]:
    # One pooled connection: every transaction of a test runs on the same server session.
    engine = create_engine(normalize_sqlalchemy_url(database_url), pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


@pytest.fixture
def actor(broker: PostgresBroker) -> Any:
    return dramatiq.actor(lambda n: None, broker=broker, actor_name="one_send")


@pytest.fixture
def orders(db: Any) -> Iterator[None]:
    db.execute("CREATE TABLE one_send_orders (id int)")
    try:
        yield
    finally:
        db.execute("DROP TABLE one_send_orders")


def _send_one(engine: Any, actor: Any, n: int) -> None:
    """A business row and one send, committed."""
    with Session(engine) as session, outbox(session):
        session.execute(text("INSERT INTO one_send_orders VALUES (:n)"), {"n": n})
        actor.send(n)
        session.commit()


def _prepared(engine: Any) -> list[str]:
    """The outbox's prepared statements on the pool's connection."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT name FROM pg_prepared_statements WHERE name LIKE :p"), {"p": STATEMENT}
        ).fetchall()
        conn.commit()  # not a rollback: psycopg follows a rollback with DEALLOCATE ALL
    return [r[0] for r in rows]


def _counts(db: Any) -> tuple[int, int]:
    orders = db.execute("SELECT count(*) FROM one_send_orders").fetchone()[0]
    query = "SELECT count(*) FROM dramatiq.messages WHERE actor_name = 'one_send'"
    messages = db.execute(query).fetchone()[0]
    return int(orders), int(messages)


@pytest.mark.usefixtures("orders")
def test_one_send_is_written_by_one_statement_prepared_once_per_connection(
    db: Any, engine: Any, actor: Any
) -> None:
    # When three transactions on one connection each send one message
    for n in range(3):
        _send_one(engine, actor, n)
    # Then all are stored with their business rows, by one prepared statement of the outbox
    assert _counts(db) == (3, 3)
    assert len(_prepared(engine)) == 1


@pytest.mark.usefixtures("orders")
def test_a_send_after_psycopg_deallocated_its_statements_prepares_again(
    db: Any, engine: Any, actor: Any
) -> None:
    # Given the outbox's statement prepared on the connection
    _send_one(engine, actor, 1)
    assert len(_prepared(engine)) == 1
    # When a transaction rolls back (psycopg then sends DEALLOCATE ALL: a rolled-back DDL
    # may have changed what its statements read)
    with Session(engine) as session:
        session.execute(text("INSERT INTO one_send_orders VALUES (99)"))
        session.rollback()
    assert _prepared(engine) == []
    # Then the next send prepares its statement again instead of failing its transaction
    _send_one(engine, actor, 2)
    assert _counts(db) == (2, 2)
    assert len(_prepared(engine)) == 1


@pytest.mark.usefixtures("orders")
def test_a_connection_that_does_not_prepare_sends_the_statement_unnamed(
    db: Any, database_url: str, actor: Any
) -> None:
    # Given an engine whose connections never prepare (as behind PgBouncer's transaction pooling)
    engine = create_engine(normalize_sqlalchemy_url(database_url), connect_args={"prepare_threshold": None})
    try:
        # When it sends in two transactions
        _send_one(engine, actor, 1)
        _send_one(engine, actor, 2)
        # Then both are stored, and nothing was prepared
        assert _counts(db) == (2, 2)
        assert _prepared(engine) == []
    finally:
        engine.dispose()


@pytest.mark.usefixtures("orders")
def test_a_refused_send_raises_the_servers_error_and_commits_nothing(
    db: Any, engine: Any, actor: Any, broker: PostgresBroker
) -> None:
    # Given a trigger that refuses the messages of one actor
    db.execute(
        "CREATE FUNCTION dramatiq.refuse_one_send() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN IF NEW.actor_name = 'refused_one' THEN RAISE EXCEPTION 'refused by trigger'; END IF; "
        "RETURN NEW; END $$"
    )
    db.execute(
        "CREATE TRIGGER refuse_one_send BEFORE INSERT ON dramatiq.messages "
        "FOR EACH ROW EXECUTE FUNCTION dramatiq.refuse_one_send()"
    )
    refused = dramatiq.actor(lambda: None, broker=broker, actor_name="refused_one")
    try:
        _send_one(engine, actor, 1)  # the statement is prepared
        with Session(engine) as session:
            with outbox(session):
                session.execute(text("INSERT INTO one_send_orders VALUES (2)"))
                refused.send()
            # When the INSERT that rides with the COMMIT fails
            with pytest.raises(DBAPIError, match="refused by trigger") as raised:
                session.commit()
            # Then it is the server's error, as psycopg raises it, and nothing of it committed
            assert isinstance(raised.value.orig, psycopg.errors.RaiseException)
            session.rollback()
            # And the session goes on: its next send is stored
            with outbox(session):
                session.execute(text("INSERT INTO one_send_orders VALUES (3)"))
                actor.send(3)
            session.commit()
        assert [r[0] for r in db.execute("SELECT id FROM one_send_orders ORDER BY id")] == [1, 3]
        assert _counts(db) == (2, 2)
    finally:
        db.execute("DROP TRIGGER refuse_one_send ON dramatiq.messages")
        db.execute("DROP FUNCTION dramatiq.refuse_one_send()")
