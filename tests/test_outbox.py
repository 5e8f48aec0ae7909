"""Transactional enqueue: a message exists if and only if its transaction commits."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import dramatiq
import psycopg
import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import OutboxError, PostgresBroker, outbox
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url

from .helpers import round_trips, wait_for


def stored(db: Any) -> list[str]:
    rows = db.execute("SELECT actor_name FROM dramatiq.messages ORDER BY id").fetchall()
    return [r[0] for r in rows]


@pytest.fixture
def engine(database_url: str) -> Any:
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    yield engine
    engine.dispose()


@pytest.fixture
def actor(broker: PostgresBroker) -> Any:
    @dramatiq.actor(broker=broker)
    def welcome(user_id: int) -> None:
        pass

    return welcome


def test_session_commit_stores_the_message(db: Any, engine: Any, actor: Any) -> None:
    with Session(engine) as session:
        with outbox(session):
            actor.send(1)
        # Not visible to anyone before the commit.
        assert stored(db) == []
        session.commit()
    assert stored(db) == ["welcome"]


def test_session_rollback_leaves_no_message(db: Any, engine: Any, actor: Any) -> None:
    with Session(engine) as session:
        with outbox(session):
            actor.send(1)
        session.rollback()
    assert stored(db) == []


def test_commit_inside_the_block_still_writes_the_message(db: Any, engine: Any, actor: Any) -> None:
    with Session(engine) as session, outbox(session):
        actor.send(1)
        session.commit()
    assert stored(db) == ["welcome"]


def test_an_exception_in_the_block_then_rollback_leaves_no_message(db: Any, engine: Any, actor: Any) -> None:
    with Session(engine) as session:
        with pytest.raises(RuntimeError), outbox(session):
            actor.send(1)
            raise RuntimeError("signup failed")
        session.rollback()
        session.commit()
    assert stored(db) == []


def test_connection_commit_and_rollback(db: Any, engine: Any, actor: Any) -> None:
    with engine.connect() as conn:
        with outbox(conn):
            actor.send(1)
        conn.rollback()
        with outbox(conn):
            actor.send(2)
        assert stored(db) == []
        conn.commit()
    assert stored(db) == ["welcome"]
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 1


def test_connection_commit_inside_the_block_writes_the_message(db: Any, engine: Any, actor: Any) -> None:
    with engine.connect() as conn, outbox(conn):
        actor.send(1)
        conn.commit()
    assert stored(db) == ["welcome"]


@pytest.mark.parametrize("kind", ["Session", "Connection"])
def test_several_sends_in_one_transaction_are_one_insert(kind: str, db: Any, engine: Any, actor: Any) -> None:
    # When 50 messages are sent in one transaction
    with Session(engine) if kind == "Session" else engine.connect() as bind:
        with outbox(bind):
            for i in range(50):
                actor.send(i)
        bind.commit()
    # Then they were written with one INSERT: every statement of a transaction has its own
    # command id (cmin), and the 50 rows share one
    assert len(stored(db)) == 50
    assert db.execute("SELECT count(DISTINCT cmin::text) FROM dramatiq.messages").fetchone()[0] == 1


@pytest.mark.parametrize("sends", [1, 3])
def test_a_sessions_messages_ride_in_the_round_trip_of_its_commit(
    sends: int, db: Any, engine: Any, actor: Any
) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS trip_orders (id int)")

    def commit_round_trips(send: bool) -> int:
        with Session(engine) as session:
            session.execute(text("SELECT 1"))
            raw = session.connection().connection.dbapi_connection
            with round_trips(raw) as count, outbox(session):
                session.execute(text("INSERT INTO trip_orders VALUES (1)"))
                for i in range(sends if send else 0):
                    actor.send(i)
                session.commit()
                return count()

    commit_round_trips(send=True)  # the first send checks the schema, once per database
    db.execute("DELETE FROM dramatiq.messages")
    # Given a Session transaction that inserts a business row, with and without sends
    bare, with_sends = commit_round_trips(send=False), commit_round_trips(send=True)
    # Then the sends add no round trip: their INSERT goes with the COMMIT (and they are stored)
    assert with_sends == bare
    assert stored(db) == ["welcome"] * sends
    db.execute("DROP TABLE trip_orders")


def test_a_failed_insert_that_rides_with_the_commit_commits_nothing(
    db: Any, engine: Any, broker: PostgresBroker
) -> None:
    # Given an actor whose queue name the messages table refuses (longer than its CHECK allows
    # is not possible from Dramatiq's side, so a row the table refuses is made by a trigger)
    db.execute("CREATE TABLE IF NOT EXISTS trip_users (id int)")
    db.execute(
        "CREATE OR REPLACE FUNCTION dramatiq.refuse_trip() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN IF NEW.actor_name = 'refused' THEN RAISE EXCEPTION 'refused by trigger'; END IF; "
        "RETURN NEW; END $$"
    )
    db.execute(
        "CREATE TRIGGER refuse_trip BEFORE INSERT ON dramatiq.messages "
        "FOR EACH ROW EXECUTE FUNCTION dramatiq.refuse_trip()"
    )
    refused = dramatiq.actor(lambda: None, broker=broker, actor_name="refused")
    accepted = dramatiq.actor(lambda: None, broker=broker, actor_name="accepted")
    try:
        with Session(engine) as session:
            with outbox(session):
                session.execute(text("INSERT INTO trip_users VALUES (1)"))
                accepted.send()
                refused.send()
            # When the commit carries an INSERT that fails
            with pytest.raises(DBAPIError, match="refused by trigger"):
                session.commit()
            session.rollback()
            # Then nothing of the transaction is committed, and the session goes on
            with outbox(session):
                session.execute(text("INSERT INTO trip_users VALUES (2)"))
                accepted.send()
            session.commit()
        assert [r[0] for r in db.execute("SELECT id FROM trip_users")] == [2]
        assert stored(db) == ["accepted"]
    finally:
        db.execute("DROP TRIGGER refuse_trip ON dramatiq.messages")
        db.execute("DROP FUNCTION dramatiq.refuse_trip()")
        db.execute("DROP TABLE trip_users")


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
def test_a_send_on_an_async_bind_runs_no_sql_and_opens_no_broker_connection(
    kind: str, db: Any, database_url: str, actor: Any
) -> None:
    # Given an async bind whose engine records every statement, and a broker that never connected
    broker = actor.broker
    assert not broker.has_runtime
    engine = create_async_engine(normalize_sqlalchemy_url(database_url))
    statements: list[str] = []
    event.listen(
        engine.sync_engine, "before_cursor_execute", lambda c, cur, stmt, *a: statements.append(stmt)
    )
    during_sends: list[str] = []

    async def scenario() -> None:
        async with AsyncSession(engine) if kind == "AsyncSession" else engine.connect() as bind:
            # When messages are sent first in a transaction, then after some SQL
            async with outbox(bind):
                before = len(statements)
                actor.send(1)
                during_sends.extend(statements[before:])
                await bind.execute(text("SELECT 1"))
                before = len(statements)
                actor.send(2)
                during_sends.extend(statements[before:])
            await bind.commit()
        await engine.dispose()

    asyncio.run(scenario())
    # Then the sends ran no statement (the event loop never blocked on them), the broker opened
    # no connection of its own, and the commit stored both messages
    assert during_sends == []
    assert not broker.has_runtime
    assert any("INSERT INTO" in s and "messages" in s for s in statements)
    assert stored(db) == ["welcome", "welcome"]


def test_send_outside_a_binding_uses_the_broker_pool(db: Any, actor: Any) -> None:
    actor.send(1)
    assert stored(db) == ["welcome"]


def test_business_rows_and_messages_commit_together(db: Any, engine: Any, actor: Any) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS users (id int PRIMARY KEY)"))
        conn.execute(text("TRUNCATE users"))
    for user_id in range(10):
        with Session(engine) as session, outbox(session):
            session.execute(text("INSERT INTO users VALUES (:id)"), {"id": user_id})
            actor.send(user_id)
            if user_id % 3 == 0:
                session.rollback()
            else:
                session.commit()
    users = {r[0] for r in db.execute("SELECT id FROM users")}
    payload_ids = {r[0] for r in db.execute("SELECT message_id FROM dramatiq.messages")}
    assert users == {1, 2, 4, 5, 7, 8}
    assert len(payload_ids) == len(users)


def test_async_session_commit_and_rollback(db: Any, database_url: str, actor: Any) -> None:
    async def scenario() -> None:
        engine = create_async_engine(normalize_sqlalchemy_url(database_url))
        async with AsyncSession(engine) as session:
            async with outbox(session):
                actor.send(1)
            await session.rollback()
            async with outbox(session):
                actor.send(2)
                actor.send(3)
            assert stored(db) == []
            await session.commit()
        async with AsyncSession(engine) as session:
            async with outbox(session):
                actor.send(4)
                await session.commit()
        async with engine.connect() as conn:
            async with outbox(conn):
                actor.send(5)
            await conn.commit()
        await engine.dispose()

    asyncio.run(scenario())
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 4


def test_async_bind_in_a_sync_with_is_a_clear_error(database_url: str, actor: Any) -> None:
    engine = create_async_engine(normalize_sqlalchemy_url(database_url))
    session = AsyncSession(engine)
    with pytest.raises(OutboxError, match="async with"):
        with outbox(session):
            pass


def test_commit_wakes_an_idle_worker_without_waiting_for_a_poll(
    make_broker: Any, start_worker: Any, engine: Any, db: Any
) -> None:
    # Given a worker whose poll interval is 10 s
    broker = make_broker(max_fetch_interval=10_000)
    started: list[float] = []

    @dramatiq.actor(broker=broker)
    def ping() -> None:
        started.append(time.monotonic())

    worker = start_worker(broker, worker_timeout=1_000)
    # a first message makes sure the consumer is up and idle
    ping.send()
    broker.join("default", timeout=15_000)
    worker.join()
    listener = broker.runtime.listener
    assert listener is not None and listener.connected.wait(5)
    time.sleep(0.3)
    # When a transaction that sends a message commits
    with Session(engine) as session:
        with outbox(session):
            ping.send()
        committed = time.monotonic()
        session.commit()
    # Then the actor starts long before the 10 s poll would have fetched it
    wait_for(lambda: len(started) >= 2, 5, "the second run")
    assert len(started) == 2
    assert started[1] - committed < 2.0


def test_connection_exception_then_rollback_leaves_no_message(db: Any, engine: Any, actor: Any) -> None:
    with engine.connect() as conn:
        with pytest.raises(RuntimeError), outbox(conn):
            actor.send(1)
            raise RuntimeError("signup failed")
        conn.rollback()
        conn.execute(text("SELECT 1"))
        conn.commit()
    assert stored(db) == []


def test_notify_carries_only_the_queue_name_and_only_at_commit(
    database_url: str, engine: Any, broker: PostgresBroker, actor: Any
) -> None:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        with Session(engine) as session:
            with outbox(session):
                for i in range(3):
                    actor.send("x" * 10_000 + str(i))  # large arguments never reach the payload
            assert list(listener.notifies(timeout=0.3)) == []
            session.commit()
        notes = list(listener.notifies(timeout=1.0, stop_after=5))
        # One notification per queue per transaction, carrying the queue name only.
        assert [n.payload for n in notes] == ["default"]


def test_a_pooled_connection_checked_out_again_binds_its_own_transaction(
    db: Any, database_url: str, actor: Any
) -> None:
    # Connection.info belongs to the pooled DBAPI connection and outlives each Connection object:
    # the second checkout below gets the same DBAPI connection through a new Connection.
    engine = create_engine(normalize_sqlalchemy_url(database_url), pool_size=1, max_overflow=0)
    try:
        for user_id in (1, 2):
            with engine.connect() as conn, outbox(conn):
                actor.send(user_id)
                conn.commit()
        assert stored(db) == ["welcome", "welcome"]
        # A rollback inside the block discards the message, whatever comes after on that connection.
        with engine.connect() as conn:
            with outbox(conn):
                actor.send(3)
                conn.rollback()
            conn.commit()
        assert len(stored(db)) == 2
    finally:
        engine.dispose()


def test_after_commit_mode_notifies_from_the_broker_after_the_commit(
    database_url: str, engine: Any, make_broker: Any, db: Any
) -> None:
    import psycopg

    broker = make_broker(notify="after_commit")

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        with Session(engine) as session:
            with outbox(session):
                task.send()
            session.commit()
        notes = list(listener.notifies(timeout=2.0, stop_after=1))
        assert [n.payload for n in notes] == ["default"]
        # The application's transaction itself sent no NOTIFY: the broker's pool did.
        assert stored(db) == ["task"]
        with Session(engine) as session:
            with outbox(session):
                task.send()
            session.rollback()
        assert list(listener.notifies(timeout=0.5)) == []


@pytest.mark.parametrize("bind", ["session", "connection"])
def test_an_after_commit_broker_readies_its_flush_thread_before_the_commit(
    database_url: str, engine: Any, make_broker: Any, db: Any, bind: str
) -> None:
    # The commit hands its NOTIFY to the flush thread: the first send starts that thread,
    # which waits for the pool's first connection and checks the schema while the
    # transaction is still open, so the first wake-up waits for neither.
    broker = make_broker(notify="after_commit")

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    broker.close()
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        with contextlib.ExitStack() as stack:
            if bind == "session":
                target: Any = stack.enter_context(Session(engine))
            else:
                target = stack.enter_context(engine.connect())
            with outbox(target):
                task.send()
            assert broker.has_runtime, "the first send did not open the broker's runtime"
            runtime = broker.runtime
            assert runtime.flusher.warmed.wait(5.0), "the flush thread did not warm a connection"
            assert runtime.flusher.running
            before = runtime.pool.get_stats()
            assert before["pool_available"] >= 1
            # Nothing was sent ahead: the commit decides.
            assert list(listener.notifies(timeout=0.2)) == []
            target.commit()
        notes = list(listener.notifies(timeout=2.0, stop_after=1))
        assert [n.payload for n in notes] == ["default"]
    after = runtime.pool.get_stats()
    # The commit's NOTIFY opened no connection and waited for none.
    assert after["connections_num"] == before["connections_num"]
    assert after.get("requests_waiting", 0) == 0
    assert after.get("requests_queued", 0) == before.get("requests_queued", 0)
    assert stored(db) == ["task"]


def test_the_outbox_path_opens_no_broker_connection(db: Any, engine: Any, actor: Any) -> None:
    broker = actor.broker
    broker.close()
    with Session(engine) as session:
        with outbox(session):
            actor.send(1)
        session.commit()
    assert stored(db) == ["welcome"]
    assert not broker.has_runtime


def test_enqueue_many_inside_the_outbox_commits_and_rolls_back_with_the_transaction(
    db: Any, engine: Any, broker: PostgresBroker, actor: Any
) -> None:
    with Session(engine) as session:
        with outbox(session):
            broker.enqueue_many([actor.message(i) for i in range(300)])
        session.rollback()
    assert stored(db) == []
    with Session(engine) as session:
        with outbox(session):
            broker.enqueue_many([actor.message(i) for i in range(300)])
        session.commit()
    assert len(stored(db)) == 300


def test_the_sqlalchemy_guide_snippet_runs_as_written(database_url: str, db: Any) -> None:
    from pathlib import Path

    guide = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "sqlalchemy.md").read_text()
    code = guide.split("```python\n", 1)[1].split("```", 1)[0]
    # Only the example's URLs change: the code runs as printed.
    sa_url = normalize_sqlalchemy_url(database_url).render_as_string(hide_password=False)
    code = code.replace("postgresql+psycopg://app@db/app", sa_url).replace(
        "postgresql://app@db/app", database_url
    )
    db.execute("DROP TABLE IF EXISTS users")
    previous = dramatiq.get_broker()
    namespace: dict[str, Any] = {"__name__": "readme_usage"}
    exec(compile(code, "docs/guides/sqlalchemy.md", "exec", dont_inherit=True), namespace)
    try:
        namespace["Base"].metadata.create_all(namespace["engine"])
        namespace["sign_up"]("ada@example.com")
        asyncio.run(namespace["sign_up_async"]("grace@example.com"))
        users = db.execute("SELECT id FROM users ORDER BY id").fetchall()
        messages = db.execute(
            "SELECT convert_from(payload, 'UTF8')::jsonb -> 'args' ->> 0 FROM dramatiq.messages "
            "WHERE actor_name = 'send_welcome_email' ORDER BY id"
        ).fetchall()
        assert [str(u[0]) for u in users] == [m[0] for m in messages] and len(users) == 2
    finally:
        namespace["engine"].dispose()
        asyncio.run(namespace["async_engine"].dispose())
        namespace["broker"].close()
        dramatiq.set_broker(previous)
        db.execute("DROP TABLE IF EXISTS users")


def test_the_sqlalchemy_guide_says_how_to_install_and_migrate_before_first_use(
    admin_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import shlex
    from importlib.metadata import metadata
    from pathlib import Path

    from dramatiq_pg_outbox.cli import main
    from dramatiq_pg_outbox.testing import scratch_database

    root = Path(__file__).resolve().parent.parent
    usage = (root / "docs" / "guides" / "sqlalchemy.md").read_text()
    commands = [
        line.split("#", 1)[0].strip()
        for block in usage.split("```sh\n")[1:]
        for line in block.split("```", 1)[0].splitlines()
        if line.strip()
    ]
    install = [shlex.split(c) for c in commands if c.startswith("pip install")]
    migrate = [shlex.split(c) for c in commands if c.startswith("dramatiq-pg-outbox migrate")]
    assert len(install) == 1 and len(migrate) == 1, commands
    # The install line names an extra that the package really declares.
    requirement = install[0][2]
    assert requirement.startswith("dramatiq-pg-outbox[") and requirement.endswith("]")
    extras = metadata("dramatiq-pg-outbox").get_all("Provides-Extra") or []
    assert requirement[len("dramatiq-pg-outbox[") : -1] in extras, extras
    # The migrate command, run as printed (only the URL changes) on a database never
    # migrated, creates the schema and says which revision it reached.
    with scratch_database(admin_url, "dpo_test_guide") as url:
        argv = [url if arg == "postgresql://app@db/app" else arg for arg in migrate[0][1:]]
        assert url in argv
        assert main(argv) == 0
        assert "head" in capsys.readouterr().out
        with psycopg.connect(url) as conn:
            created = conn.execute("SELECT to_regclass('dramatiq.messages')::text").fetchone()
            assert created == ("dramatiq.messages",)


def args_stored(db: Any) -> list[str]:
    rows = db.execute("SELECT convert_from(payload, 'UTF8')::jsonb -> 'args' ->> 0 FROM dramatiq.messages")
    return sorted(r[0] for r in rows.fetchall())


def test_after_enqueue_follows_the_database_transaction_when_a_later_commit_listener_fails(
    db: Any, engine: Any, make_broker: Any
) -> None:
    # Given a broker whose middleware records after_enqueue, and an application commit listener,
    # registered after the outbox's, that can be made to fail.  SQLAlchemy then drops its
    # transaction without sending ROLLBACK: the database transaction, with the message in it, goes on.
    recorded: list[str] = []

    class Record(dramatiq.Middleware):
        def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            recorded.append(str(message.args[0]))

    broker = make_broker()
    broker.add_middleware(Record())
    task = dramatiq.actor(lambda n: None, broker=broker, actor_name="task")
    fail_next: list[bool] = []

    def fail(conn: Any) -> None:
        if fail_next:
            fail_next.clear()
            raise RuntimeError("audit log unavailable")

    with engine.connect() as conn:
        with outbox(conn):
            task.send(0)  # the outbox's listeners are in place before the application's
        conn.commit()
        event.listen(engine, "commit", fail)
        # When a message's commit fails in that listener, and the database transaction that
        # holds it is then rolled back for real (the first rollback() does not reach it)
        with outbox(conn):
            task.send(1)
        fail_next.append(True)
        with pytest.raises(RuntimeError, match="audit log"):
            conn.commit()
        conn.rollback()
        conn.execute(text("SELECT 1"))
        conn.rollback()
        # and an unrelated transaction then commits on the same connection
        conn.execute(text("SELECT 1"))
        conn.commit()
        # Then after_enqueue did not run for the rolled-back message
        assert args_stored(db) == ["0"] and recorded == ["0"]
        # When another message's commit fails in that listener, and a later COMMIT on the
        # connection commits the database transaction that holds it
        with outbox(conn):
            task.send(2)
        fail_next.append(True)
        with pytest.raises(RuntimeError, match="audit log"):
            conn.commit()
        conn.rollback()
        conn.execute(text("SELECT 1"))
        conn.commit()
    # Then after_enqueue ran for every message the database stored, and for no other
    assert sorted(recorded) == args_stored(db)
    assert "1" not in recorded


# -- a binding ends with its block ---------------------------------------------------------------
# asyncio.create_task, asyncio.to_thread and contextvars.copy_context().run copy the context, and
# the binding with it.  A send from such a copy after the block ended would be buffered into a
# transaction that was committed (or closed) already and dropped without a word: it raises instead.


def test_a_task_created_inside_the_block_cannot_send_through_it_after_the_block(
    db: Any, database_url: str, actor: Any
) -> None:
    async def scenario() -> None:
        engine = create_async_engine(normalize_sqlalchemy_url(database_url))
        block_ended = asyncio.Event()

        async def late_send() -> None:
            await block_ended.wait()
            actor.send(2)

        async def early_send() -> None:
            actor.send(1)

        async with AsyncSession(engine) as session:
            async with outbox(session):
                late = asyncio.create_task(late_send())
                await asyncio.create_task(early_send())  # while the block is open: joins it
            block_ended.set()
            await session.commit()
        with pytest.raises(OutboxError, match="whose block has ended"):
            await late
        await engine.dispose()

    asyncio.run(scenario())
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 1


def test_a_thread_started_by_to_thread_inside_the_block_cannot_send_through_it_after_the_block(
    db: Any, database_url: str, actor: Any
) -> None:
    import threading

    block_ended = threading.Event()
    errors: list[BaseException] = []

    def late_send() -> None:
        block_ended.wait(10)
        try:
            actor.send(1)
        except OutboxError as e:
            errors.append(e)

    async def scenario() -> None:
        engine = create_async_engine(normalize_sqlalchemy_url(database_url))
        async with AsyncSession(engine) as session:
            async with outbox(session):
                thread = asyncio.ensure_future(asyncio.to_thread(late_send))
                await asyncio.sleep(0.05)
            block_ended.set()
            await session.commit()
        await thread
        await engine.dispose()

    asyncio.run(scenario())
    assert len(errors) == 1 and "whose block has ended" in str(errors[0])
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 0


def test_a_context_copied_inside_the_block_cannot_send_through_it_after_the_block(
    db: Any, engine: Any, actor: Any
) -> None:
    import contextvars

    from dramatiq_pg_outbox import outside_outbox

    with Session(engine) as session:
        with outbox(session):
            copied = contextvars.copy_context()
        session.commit()
    with pytest.raises(OutboxError, match="outside_outbox"):
        copied.run(actor.send, 1)
    assert stored(db) == []

    # On purpose, outside every binding: written at once through the broker's pool.
    def send_on_its_own() -> None:
        with outside_outbox():
            actor.send(2)

    copied.run(send_on_its_own)
    assert stored(db) == ["welcome"]


def test_a_session_with_binds_and_no_default_bind_is_a_clear_error_and_loses_nothing(
    db: Any, engine: Any, actor: Any
) -> None:
    from sqlalchemy import Column, Integer, MetaData, Table

    orders = Table("outbox_binds_orders", MetaData(), Column("id", Integer, primary_key=True))
    orders.create(engine, checkfirst=True)
    try:
        # Given a Session with binds per table only
        with Session(binds={orders: engine}) as session:
            with outbox(session):
                session.execute(orders.insert().values(id=1))
                # When a message is sent, Then the send says what to do, at once
                with pytest.raises(OutboxError, match="no default bind"):
                    actor.send(1)
            session.commit()
        assert stored(db) == []
        # And with a default bind as well, the message commits with the rows
        with Session(bind=engine, binds={orders: engine}) as session:
            with outbox(session):
                session.execute(orders.insert().values(id=2))
                actor.send(2)
            session.commit()
        assert stored(db) == ["welcome"]
    finally:
        orders.drop(engine)


def test_the_package_imports_its_names_on_first_use_and_outbox_stays_the_function() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # Given a fresh interpreter that imports the package, then the outbox subpackage (as
    # dramatiq_pg_outbox.django does) before the package's names, or the names first
    for first in ("import dramatiq_pg_outbox.outbox", "from dramatiq_pg_outbox import PostgresBroker"):
        code = (
            "import sys, types\n"
            "import dramatiq_pg_outbox\n"
            "assert 'dramatiq_pg_outbox.broker' not in sys.modules, 'the package alone imports the broker'\n"
            f"{first}\n"
            "from dramatiq_pg_outbox import Outbox, outbox\n"
            "from dramatiq_pg_outbox.outbox import Outbox as the_class, outbox as the_function\n"
            "assert outbox is the_function and not isinstance(outbox, types.ModuleType), outbox\n"
            "assert Outbox is the_class and dramatiq_pg_outbox.outbox is the_function\n"
            "from dramatiq_pg_outbox import *\n"
            "assert set(dramatiq_pg_outbox.__all__) <= set(dir(dramatiq_pg_outbox))\n"
            "print('ok')\n"
        )
        # When it runs
        done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
        # Then the package imported nothing heavy by itself, and its outbox is the function
        assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("kind", ["Session", "Connection"])
def test_a_connection_lost_before_the_commit_raises_the_drivers_error_and_commits_nothing(
    kind: str, db: Any, engine: Any, actor: Any
) -> None:
    # Given a transaction with a business row and a message, whose server connection is then ended
    # (a primary killed, a proxy cut) before its commit
    db.execute("CREATE TABLE IF NOT EXISTS lost_orders (id int)")
    try:
        with contextlib.ExitStack() as stack:
            bind: Any = stack.enter_context(Session(engine) if kind == "Session" else engine.connect())
            with outbox(bind):
                bind.execute(text("INSERT INTO lost_orders VALUES (1)"))
                actor.send(1)
            pid = bind.execute(text("SELECT pg_backend_pid()")).scalar_one()
            db.execute("SELECT pg_terminate_backend(%s)", (pid,))
            # When it commits
            # Then the error is SQLAlchemy's DBAPIError (what a caller's retry catches), not one
            # raised by the outbox's cleanup on the dead connection
            with pytest.raises(DBAPIError) as raised:
                bind.commit()
            assert raised.value.connection_invalidated, raised.value
            bind.rollback()
            # And nothing of the transaction is committed, and the bind goes on (a retry commits both)
            assert stored(db) == []
            assert db.execute("SELECT count(*) FROM lost_orders").fetchone()[0] == 0
            with outbox(bind):
                bind.execute(text("INSERT INTO lost_orders VALUES (2)"))
                actor.send(2)
            bind.commit()
        assert stored(db) == ["welcome"]
        assert [r[0] for r in db.execute("SELECT id FROM lost_orders")] == [2]
    finally:
        db.execute("DROP TABLE lost_orders")
