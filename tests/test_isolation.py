"""Isolation levels: the package's statements run at READ COMMITTED whatever the defaults.

The ring's emptiness check (``reclaim_messages()``) and the window limiter
(``rate_limit_incr_and_sum()``) read rows committed after their lock, which only READ
COMMITTED shows them.  These tests give a database of their own a default of REPEATABLE
READ or SERIALIZABLE (``ALTER DATABASE ... SET default_transaction_isolation``, or the
URL's ``options=-c default_transaction_isolation=...``) and check that nothing
committed is lost, that every connection the package opens runs READ COMMITTED, and
that the two functions refuse any other level.  docs/guarantees.md, "Isolation levels".
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.rate_limits import WindowRateLimiter
from psycopg import sql
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox, upgrade
from dramatiq_pg_outbox import rate_limits as rate_limits_module
from dramatiq_pg_outbox import results as results_module
from dramatiq_pg_outbox._runtime.listener import subscribe
from dramatiq_pg_outbox._runtime.notifier import Notifier
from dramatiq_pg_outbox._runtime.reclaimer import Reclaimer
from dramatiq_pg_outbox.migrations import downgrade, normalize_sqlalchemy_url
from dramatiq_pg_outbox.testing import scratch_database

from .conftest import FAST, SCHEMA
from .helpers import wait_for, with_url_default
from .pgbouncer import PgBouncer, pgbouncer_binary

LEVELS = ("repeatable read", "serializable")
#: The reclaim call of the reclaim loop, made by a test on a connection of its own.
RECLAIM = "SELECT * FROM dramatiq.reclaim_messages(60000, 30000, 8, 'dramatiq', 1000)"


@pytest.fixture(scope="module")
def own_database(admin_url: str) -> Iterator[str]:
    """A database of this module's own (its default level is changed), migrated to head."""
    with scratch_database(admin_url, "dpo_iso") as url:
        upgrade(url, schema=SCHEMA)
        yield url


def set_database_default(url: str, level: str | None) -> None:
    """``ALTER DATABASE <its database> SET default_transaction_isolation`` (None: RESET), for new sessions."""
    with psycopg.connect(url, autocommit=True) as conn:
        name = conn.info.dbname
        if level is None:
            conn.execute(
                sql.SQL("ALTER DATABASE {} RESET default_transaction_isolation").format(sql.Identifier(name))
            )
        else:
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = {}").format(
                    sql.Identifier(name), sql.Literal(level)
                )
            )


@pytest.fixture
def at_level(own_database: str) -> Iterator[Callable[[str, str], str]]:
    """``at_level(way, level)``: a URL of the module's database whose new sessions default to ``level``,
    set on the database (``way="database"``) or in the URL (``way="url"``); the tables emptied."""
    with psycopg.connect(own_database, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE dramatiq.messages, dramatiq.history, dramatiq.workers, dramatiq.rate_limits, "
            "dramatiq.rate_limit_events"
        )

    def make(way: str, level: str) -> str:
        if way == "database":
            set_database_default(own_database, level)
            url = own_database
        else:
            set_database_default(own_database, None)
            url = with_url_default(own_database, level)
        with psycopg.connect(url) as plain:  # psycopg's own connection: the default holds there
            assert plain.execute("SHOW transaction_isolation").fetchone() == (level,)
        return url

    yield make
    set_database_default(own_database, None)


@pytest.fixture
def brokers() -> Iterator[Callable[..., PostgresBroker]]:
    made: list[PostgresBroker] = []
    workers: list[dramatiq.Worker] = []

    def make(url: str, **options: Any) -> PostgresBroker:
        broker = PostgresBroker(url=url, **{**FAST, **options})
        made.append(broker)
        dramatiq.set_broker(broker)
        return broker

    make.workers = workers  # type: ignore[attr-defined]
    yield make
    for worker in workers:
        worker.stop(timeout=5_000)
    for broker in made:
        broker.close()


class RingTurner(threading.Thread):
    """Turns the ring as fast as it goes: a message sent through the broker (outside any
    transaction: the new current partition has a row, so it can turn), the ring marked due, one
    reclaim pass as the reclaim loop makes it.  Records the messages sent and the turns."""

    def __init__(self, broker: PostgresBroker, actor: Any, url: str) -> None:
        super().__init__(daemon=True)
        self.broker, self.actor, self.url = broker, actor, url
        self.reclaimer = Reclaimer(broker.runtime)
        self.sent: list[str] = []
        self.turns = 0
        self.passes = 0
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as db:
            while not self.stopping.is_set():
                try:
                    self.sent.append(self.actor.send(-1).message_id)
                    db.execute("UPDATE dramatiq.message_ring SET rotated_at = now() - interval '1 hour'")
                    result = self.reclaimer.run_once()
                except Exception as e:  # recorded, and the loop goes on as the reclaim loop does
                    self.errors.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.01)
                    continue
                self.passes += 1
                self.turns += bool(result is not None and result.rotated)

    def wait_turns(self, turns: int, timeout: float = 30) -> None:
        start = self.turns
        wait_for(
            lambda: self.turns >= start + turns,
            timeout,
            f"{turns} turns of the ring ({self.passes} passes, errors: {self.errors[-3:]})",
        )

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


def lock_awaited(db: psycopg.Connection[Any], partition: str) -> bool:
    """Whether a session waits for a lock on ``partition`` (the reclaim pass's ``LOCK``)."""
    row = db.execute(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass", (partition,)
    ).fetchone()
    return bool(row and row[0])


def hold_across_two_turns(
    engine: Engine, actor: Any, turner: RingTurner, db: psycopg.Connection[Any]
) -> str | None:
    """An outbox transaction whose row is written (by a savepoint) and left uncommitted while the ring
    turns twice, committed while the reclaim pass waits for the lock of the row's partition.

    Returns:
      str|None: The message id if the COMMIT succeeded (None: a serialization failure, allowed).
    """
    with engine.connect() as conn:
        conn.begin()
        with outbox(conn):
            message = actor.send(1)
        conn.begin_nested().commit()  # the savepoint writes the buffered message now
        # Its partition: the slot the INSERT read (the transaction's snapshot, taken by the INSERT: its
        # first statement).  Only that partition is read: reading the table would hold every partition
        slot = conn.execute(text("SELECT slot FROM dramatiq.message_ring")).scalar_one()
        partition = f"dramatiq.messages_ring{slot}"
        assert (
            conn.execute(
                text(f"SELECT count(*) FROM {partition} WHERE message_id = :m"), {"m": message.message_id}
            ).scalar_one()
            == 1
        )
        turner.wait_turns(2)
        # The reclaim pass finds the partition with no visible row and waits for its lock (20 ms
        # at most, then tries again at the next pass): commit during that wait.
        deadline = time.monotonic() + 10
        while not lock_awaited(db, partition) and time.monotonic() < deadline:
            pass
        try:
            conn.commit()
        except psycopg.errors.SerializationFailure:  # only at SERIALIZABLE: allowed, never a loss
            return None
        except Exception as e:
            if isinstance(getattr(e, "orig", None), psycopg.errors.SerializationFailure):
                return None
            raise
    return str(message.message_id)


def run_all(brokers: Any, broker: PostgresBroker, ran: set[str], expected: set[str]) -> None:
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=4)
    worker.start()
    brokers.workers.append(worker)
    wait_for(lambda: expected <= ran, 60, f"{len(expected)} messages to run")


def stored_ids(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as db:
        rows = db.execute(
            "SELECT message_id FROM dramatiq.messages UNION ALL SELECT message_id FROM dramatiq.history"
        ).fetchall()
    return {str(r[0]) for r in rows}


# -- no committed message lost, whatever the default ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("way", ["database", "url"])
def test_committed_messages_survive_the_ring_turning_under_a_default_level(
    at_level: Any, brokers: Any, way: str, level: str
) -> None:
    # Given a database whose sessions default to REPEATABLE READ or SERIALIZABLE (set on the
    # database, or in the URL the broker and the application use)
    url = at_level(way, level)
    broker = brokers(url, rotate_interval=1_000)
    ran: set[str] = set()
    lock = threading.Lock()

    @dramatiq.actor(broker=broker, actor_name="iso_noop")
    def iso_noop(n: int) -> None:
        with lock:
            ran.add(dramatiq.middleware.CurrentMessage.get_current_message().message_id)

    broker.add_middleware(dramatiq.middleware.CurrentMessage())
    engine = create_engine(normalize_sqlalchemy_url(url))
    turner = RingTurner(broker, iso_noop, url)
    committed: list[str] = []
    turner.start()
    try:
        with psycopg.connect(url, autocommit=True) as db:
            # When ten outbox transactions, one after the other, each hold their row uncommitted while
            # the ring turns twice and commit while the reclaim pass waits for that partition's lock,
            # and the broker sends a message at every pass
            for _ in range(10):
                message_id = hold_across_two_turns(engine, iso_noop, turner, db)
                if message_id is not None:
                    committed.append(message_id)
        turner.wait_turns(2)
    finally:
        turner.stop()
        engine.dispose()
    # Then every committed message is stored: none was emptied with its partition
    # (on the parent commit, under REPEATABLE READ: 10 of 10 lost)
    expected = set(committed) | set(turner.sent)
    lost = expected - stored_ids(url)
    assert not lost, (
        f"committed messages lost: {len(lost & set(committed))} of {len(committed)} from outbox "
        f"transactions, {len(lost & set(turner.sent))} of {len(turner.sent)} sent outside"
    )
    assert len(committed) >= 5, "most outbox transactions commit"  # a serialization failure is allowed
    assert turner.errors == [], turner.errors[:3]
    # And every one of them runs
    run_all(brokers, broker, ran, expected)


def test_an_outbox_transaction_at_repeatable_read_held_across_two_ring_turns_commits_its_message(
    at_level: Any, brokers: Any
) -> None:
    # Given a database whose sessions default to REPEATABLE READ, and the application's engine at
    # REPEATABLE READ too: outbox() writes at the application's level
    url = at_level("database", "repeatable read")
    broker = brokers(url, rotate_interval=1_000)
    ran: set[int] = set()

    @dramatiq.actor(broker=broker, actor_name="iso_held")
    def iso_held(n: int) -> None:
        ran.add(n)

    engine = create_engine(normalize_sqlalchemy_url(url), isolation_level="REPEATABLE READ")
    turner = RingTurner(broker, iso_held, url)
    turner.start()
    try:
        with psycopg.connect(url, autocommit=True) as db:
            # When a transaction writes its message early (a savepoint) and commits after two turns,
            # while the reclaim pass waits for the lock of the partition that holds the row
            held = hold_across_two_turns(engine, iso_held, turner, db)
            # And a Session reads first (its snapshot is taken), sends after two turns and commits:
            # its INSERT reads the ring's slot in that old snapshot, so the row goes to the partition
            # that was current then, which nothing of its own kept from being emptied meanwhile
            with Session(engine) as session:
                session.execute(text("SELECT slot FROM dramatiq.message_ring")).scalar_one()
                turner.wait_turns(2)
                with outbox(session):
                    iso_held.send(2)
                session.commit()
        turner.wait_turns(2)
    finally:
        turner.stop()
        engine.dispose()
    assert held is not None
    # Then both messages are stored and run: the uncommitted row held its partition (the INSERT's
    # lock), and once committed the reclaim pass saw it (READ COMMITTED) and moved it
    assert turner.errors == [], turner.errors[:3]
    assert {held, *turner.sent} <= stored_ids(url)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=4)
    worker.start()
    brokers.workers.append(worker)
    wait_for(lambda: {1, 2} <= ran, 60, "both outbox messages to run")


# -- the functions refuse any other level ---------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_reclaim_messages_refuses_to_run_at_another_level(database_url: str, level: str) -> None:
    with psycopg.connect(database_url) as conn:
        # Given a transaction at REPEATABLE READ or SERIALIZABLE
        conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level.upper()}")
        # Then reclaim_messages() raises, naming the level, and empties nothing
        with pytest.raises(psycopg.errors.InvalidTransactionState, match=f"not in {level.upper()}"):
            conn.execute(RECLAIM)
        conn.rollback()
        # And at READ COMMITTED it runs
        conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        conn.execute(RECLAIM)
        conn.rollback()


@pytest.mark.parametrize("level", LEVELS)
def test_rate_limit_incr_and_sum_refuses_to_run_at_another_level(database_url: str, level: str) -> None:
    call = "SELECT dramatiq.rate_limit_incr_and_sum('iso-k', ARRAY['iso-k'], 1, 5, 60000)"
    with psycopg.connect(database_url) as conn:
        conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level.upper()}")
        with pytest.raises(psycopg.errors.InvalidTransactionState, match=f"not in {level.upper()}"):
            conn.execute(call)
        conn.rollback()
        assert conn.execute(call).fetchone() == (True,)
        conn.rollback()


def function_definitions(url: str, schema: str) -> dict[str, str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc AS p "
            "WHERE p.pronamespace = %s::regnamespace "
            "AND p.proname IN ('reclaim_messages', 'rate_limit_incr_and_sum')",
            (schema,),
        ).fetchall()
    return dict(rows)


def test_the_migration_adds_the_check_and_its_downgrade_restores_the_functions_of_0013_and_0008(
    own_database: str,
) -> None:
    schema = "iso_mig"
    try:
        # Given a schema at 0013: the functions as 0013 and 0008 made them
        upgrade(own_database, schema=schema, revision="0013")
        original = function_definitions(own_database, schema)
        assert set(original) == {"reclaim_messages", "rate_limit_incr_and_sum"}
        # When it is upgraded to 0015: both carry the check, the rest unchanged
        upgrade(own_database, schema=schema, revision="0015")
        guarded = function_definitions(own_database, schema)
        for name in original:
            assert "transaction_isolation" not in original[name]
            assert "current_setting('transaction_isolation')" in guarded[name]
            assert len(guarded[name].splitlines()) == len(original[name].splitlines()) + 8
        # And downgraded to 0013: the functions are 0013's and 0008's again
        downgrade(own_database, schema=schema, revision="0013")
        assert function_definitions(own_database, schema) == original
        upgrade(own_database, schema=schema, revision="0015")
        assert function_definitions(own_database, schema) == guarded
    finally:
        with psycopg.connect(own_database, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


# -- the window limiter stays exact ------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_a_window_rate_limiter_never_admits_past_its_limit_under_a_default_level(
    at_level: Any, level: str
) -> None:
    # Given a database whose sessions default to REPEATABLE READ or SERIALIZABLE
    url = at_level("database", level)
    backend = rate_limits_module.PostgresBackend(url=url, cleanup_interval=None)
    limiter = WindowRateLimiter(backend, f"iso-window-{uuid.uuid4().hex[:6]}", limit=10, window=60)
    calls: list[bool] = []
    try:
        # When 16 threads try it 48 times at once
        def work() -> None:
            with limiter.acquire(raise_on_failure=False) as acquired:
                calls.append(bool(acquired))

        with ThreadPoolExecutor(max_workers=16) as pool:
            for future in [pool.submit(work) for _ in range(48)]:
                future.result()
    finally:
        backend.close()
    # Then exactly its limit is admitted (each call's sum saw the calls committed before its lock)
    assert sum(calls) == 10


@pytest.mark.parametrize("level", ("read committed", *LEVELS))
def test_a_window_rate_limiter_stays_exact_when_its_connections_die_between_its_round_trips(
    at_level: Any, own_database: str, level: str
) -> None:
    # Given a window limiter of 10 on a database whose sessions default to the level, and a
    # fault: a thread that terminates every backend found idle in a transaction, which is where
    # an acquisition waits between its two round trips (the locks held, the sum not yet sent)
    url = at_level("database", level)
    backend = rate_limits_module.PostgresBackend(url=url, cleanup_interval=None)
    key = f"iso-window-fault-{uuid.uuid4().hex[:6]}"
    limiter = WindowRateLimiter(backend, key, limit=10, window=60)
    admitted: list[bool] = []
    failed: list[BaseException] = []
    killed = [0]
    stop = threading.Event()

    def killer() -> None:
        with psycopg.connect(own_database, autocommit=True) as conn:
            while not stop.is_set():
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND state = 'idle in transaction' "
                    "AND pid <> pg_backend_pid()"
                ).fetchone()
                killed[0] += row[0] if row else 0

    def work() -> None:
        try:
            with limiter.acquire(raise_on_failure=False) as acquired:
                admitted.append(bool(acquired))
        except dramatiq.errors.BrokerConnectionError as e:  # its connection died under it
            failed.append(e)

    fault = threading.Thread(target=killer)
    fault.start()
    try:
        # When 16 threads try it until the fault has hit a few acquisitions (at most 20 s)
        deadline = time.monotonic() + 20
        with ThreadPoolExecutor(max_workers=16) as pool:
            while killed[0] < 5 and time.monotonic() < deadline:
                for future in [pool.submit(work) for _ in range(32)]:
                    future.result()
    finally:
        stop.set()
        fault.join()
        backend.close()
    # Then the fault hit acquisitions between their round trips, and still no more than the
    # limit was admitted; the stored count holds every admission, and never more than the
    # limit (an acquisition that failed added nothing, or was committed and not admitted)
    assert killed[0] >= 1 and failed, (killed, failed)
    with psycopg.connect(own_database) as conn:
        row = conn.execute("SELECT sum(value) FROM dramatiq.rate_limits WHERE key LIKE %s", [key + "@%"])
        stored = row.fetchone()[0]  # type: ignore[index]
    assert sum(admitted) <= stored <= 10
    assert sum(admitted) >= 10 - len(failed)


@pytest.mark.parametrize("level", ("read committed", *LEVELS))
def test_concurrency_keys_hold_their_limits_across_brokers_under_a_default_level(
    at_level: Any, brokers: Any, level: str
) -> None:
    # Given a database whose sessions default to the level, and two brokers (as two processes)
    # of 6 threads each, and keyed messages: 4 keys with limits 1 to 4, 10 messages each
    url = at_level("database", level)
    lock = threading.Lock()
    running: dict[str, int] = {}
    peak: dict[str, int] = {}
    done: list[str] = []
    first = brokers(url)
    second = brokers(url)
    for broker in (first, second):

        @dramatiq.actor(broker=broker, actor_name="iso_keyed", max_retries=0)
        def iso_keyed(key: str) -> None:
            with lock:
                running[key] = running.get(key, 0) + 1
                peak[key] = max(peak.get(key, 0), running[key])
            time.sleep(0.25)  # long enough for every free slot to be claimed meanwhile
            with lock:
                running[key] -= 1
                done.append(key)

    sender = first.get_actor("iso_keyed")
    for _ in range(10):
        for limit in range(1, 5):
            sender.send_with_options(
                args=(f"k{limit}",), concurrency_key=f"iso:k{limit}", concurrency_limit=limit
            )
    # When both drain them at once
    for broker in (first, second):
        worker = dramatiq.Worker(broker, worker_threads=6, worker_timeout=100)
        worker.start()
        brokers.workers.append(worker)
    wait_for(lambda: len(done) == 40, 30, "every keyed message to run")
    # Then no key passed its limit: the claim's second statement counts at READ COMMITTED
    # whatever the default (its transaction says its level); and the keys with room ran several
    # at once (reaching each limit depends on the machine's pace: tests/test_concurrency_keys.py)
    assert all(peak[f"k{limit}"] <= limit for limit in range(1, 5)), peak
    assert peak["k1"] == 1 and max(peak.values()) >= 3, peak


# -- every connection the package opens runs READ COMMITTED ------------------------------------


def _show(conn: Any) -> str:
    return str(conn.execute("SHOW transaction_isolation").fetchone()[0])


def _broker_level(url: str) -> str:
    broker = PostgresBroker(url=url, **FAST)
    try:
        with broker.runtime.connection() as conn:
            # (a direct connection: READ COMMITTED is the session's default, set at connect)
            assert conn.execute("SHOW default_transaction_isolation").fetchone() == ("read committed",)
            return _show(conn)
    finally:
        broker.close()


def _listener_level(url: str) -> str:
    conninfo = f"{url}{'&' if '?' in url else '?'}application_name=iso-{uuid.uuid4().hex[:6]}"
    sub = subscribe(conninfo, "iso_channel", lambda payload: None, lambda: None)
    try:
        wait_for(sub.connected.is_set, 15, "the LISTEN connection")
        assert sub.listener.connection is not None
        return _show(sub.listener.connection)
    finally:
        sub.close()


def _notifier_level(url: str) -> str:
    notifier = Notifier(url, "iso_channel", {"autocommit": True})
    notifier.open()
    try:
        assert notifier._conn is not None
        return _show(notifier._conn)
    finally:
        notifier.close()


def _results_level(url: str) -> str:
    backend = results_module.PostgresBackend(url=url)
    try:
        with backend.connection() as conn:
            return _show(conn)
    finally:
        backend.close()


def _rate_limits_level(url: str) -> str:
    backend = rate_limits_module.PostgresBackend(url=url, cleanup_interval=None)
    try:
        with backend.broker.runtime.connection() as conn:
            return _show(conn)
    finally:
        backend.close()


def _relay_level(url: str) -> str:
    from dramatiq.brokers.stub import StubBroker

    from dramatiq_pg_outbox.relay import Relay

    broker = PostgresBroker(url=url, **FAST)
    relay = Relay(broker, StubBroker(), ["default"])
    try:
        with relay.broker.runtime.connection() as conn:
            return _show(conn)
    finally:
        broker.close()


def _dashboard_level(url: str) -> str:
    from dramatiq_pg_outbox.dashboard.store import Store

    async def read() -> str:
        store = Store(url, SCHEMA, "dramatiq")
        await store.open()
        try:
            async with store.pool.connection() as conn:
                cur = await conn.execute("SHOW transaction_isolation")
                row = await cur.fetchone()
                assert row is not None
                return str(row[0])
        finally:
            await store.close()

    return asyncio.run(read())


def _spark_level(url: str) -> str:
    from dramatiq_pg_outbox.spark.options import connect

    with connect(url) as conn:  # a transaction of its own, as the Spark tasks run theirs
        return _show(conn)


def _metrics_level(url: str) -> str:
    from dramatiq_pg_outbox.metrics import DatabaseCollector

    collector = DatabaseCollector(url, SCHEMA)
    collector.read()
    assert collector.connection is not None, collector.last_error
    try:
        return _show(collector.connection)
    finally:
        collector.close()


def _cli_level(url: str) -> str:
    import argparse

    from dramatiq_pg_outbox.cli.common import database_from, open_connection

    with open_connection(database_from(argparse.Namespace(url=url))) as conn:
        return _show(conn)


def _first_migration_statement_level(migrate: Callable[[], None]) -> str:
    """The level of the transaction of the first statement ``migrate`` runs through SQLAlchemy."""
    seen: list[str] = []

    def first_statement(
        conn: Any, cursor: Any, statement: Any, parameters: Any, context: Any, many: Any
    ) -> None:
        if not seen:
            seen.append(_show(cursor.connection))

    event.listen(Engine, "after_cursor_execute", first_statement)
    try:
        migrate()  # at the head already: the environment still runs its statements
    finally:
        event.remove(Engine, "after_cursor_execute", first_statement)
    return seen[0]


def _migrations_level(url: str) -> str:
    return _first_migration_statement_level(lambda: upgrade(url, schema=SCHEMA))


def _migrations_engine_level(url: str) -> str:
    engine = create_engine(normalize_sqlalchemy_url(url))  # the application's engine, at the default
    try:
        return _first_migration_statement_level(lambda: upgrade(engine, schema=SCHEMA))
    finally:
        engine.dispose()


def _alembic_env_level(url: str) -> str:
    from alembic import command
    from dramatiq_pg_outbox.migrations import alembic_config

    config = alembic_config(SCHEMA, normalize_sqlalchemy_url(url).render_as_string(hide_password=False))
    return _first_migration_statement_level(lambda: command.upgrade(config, "head"))


@pytest.mark.parametrize(
    "component",
    [
        _broker_level,
        _listener_level,
        _notifier_level,
        _results_level,
        _rate_limits_level,
        _relay_level,
        _dashboard_level,
        _spark_level,
        _metrics_level,
        _cli_level,
        _migrations_level,
        _migrations_engine_level,
        _alembic_env_level,
    ],
    ids=lambda f: f.__name__.strip("_").removesuffix("_level"),
)
def test_every_connection_of_the_package_runs_read_committed_under_a_repeatable_read_default(
    at_level: Any, component: Callable[[str], str]
) -> None:
    # Given a database whose sessions default to REPEATABLE READ (psycopg's own connection says so)
    url = at_level("database", "repeatable read")
    # Then a statement on the component's connection runs at READ COMMITTED
    assert component(url) == "read committed"


def test_a_statement_sent_with_its_begin_and_commit_runs_at_read_committed_alone_in_its_transaction(
    at_level: Any,
) -> None:
    # The cursor of connections whose session default could not be set (through a pooler)
    from dramatiq_pg_outbox._isolation import AsyncReadCommittedCursor, ReadCommittedCursor

    url = at_level("database", "repeatable read")
    with psycopg.connect(url, autocommit=True, cursor_factory=ReadCommittedCursor) as conn:
        # Given an autocommit connection at REPEATABLE READ whose lone statements are wrapped
        conn.execute("CREATE TEMP TABLE iso_t (k int PRIMARY KEY, b bytea, u uuid[], j jsonb)")
        # Then a statement runs at READ COMMITTED, returns its rows and row count, and commits;
        # its parameters (bound on the client) arrive as bound on the server
        cur = conn.execute("SELECT current_setting('transaction_isolation'), %(n)s::int", {"n": 2})
        assert cur.fetchall() == [("read committed", 2)]
        ids = [uuid.uuid4(), uuid.uuid4()]
        payload = bytes(range(256)) + b"'\\%"
        cur = conn.execute(
            "INSERT INTO iso_t SELECT k, %(b)s::bytea, %(u)s::uuid[], %(j)s::jsonb "
            "FROM unnest(%(k)s::int[]) AS k WHERE %(like)s LIKE 'a%%'",
            {"k": [1, 2], "b": payload, "u": ids, "j": psycopg.types.json.Jsonb({"q": "it's"}), "like": "ab"},
        )
        assert cur.rowcount == 2 and cur.description is None
        assert conn.execute("SELECT b, u, j FROM iso_t WHERE k = 1").fetchone() == (
            payload,
            ids,
            {"q": "it's"},
        )
        assert conn.execute("UPDATE iso_t SET k = k + 10 RETURNING k").fetchall() == [(11,), (12,)]
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        # And a failing statement raises its own error and leaves no transaction behind
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("INSERT INTO iso_t (k) VALUES (11)")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        conn.cursor().executemany("INSERT INTO iso_t (k) VALUES (%s)", [(3,), (4,)])
        assert conn.execute("SELECT count(*) FROM iso_t").fetchone() == (4,)
        # And inside a transaction it is psycopg's (which begins it at the connection's level)
        with conn.transaction():
            conn.execute("INSERT INTO iso_t (k) VALUES (5)")
            assert _show(conn) == "read committed"
        # Without the cursor, the same connection's lone statements run at the default
        conn.cursor_factory = psycopg.Cursor
        assert _show(conn) == "repeatable read"

    async def run_async() -> list[Any]:
        aconn = await psycopg.AsyncConnection.connect(
            url, autocommit=True, cursor_factory=AsyncReadCommittedCursor
        )
        async with aconn:
            cur = await aconn.execute("SELECT current_setting('transaction_isolation'), %s::int", (7,))
            rows: list[Any] = await cur.fetchall()
            with pytest.raises(psycopg.errors.DivisionByZero):
                await aconn.execute("SELECT 1 / 0")
            rows.append(aconn.info.transaction_status)
            return rows

    assert asyncio.run(run_async()) == [("read committed", 7), psycopg.pq.TransactionStatus.IDLE]


def test_a_broker_behind_pgbouncer_runs_read_committed_on_server_connections_that_default_otherwise(
    at_level: Any, own_database: str, brokers: Any
) -> None:
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer is not installed: apt-get install -y pgbouncer")
    # Given PgBouncer in transaction pooling, one server connection, to a database whose sessions
    # default to REPEATABLE READ: a session SET would not hold there, each transaction must say it
    at_level("database", "repeatable read")
    with PgBouncer(own_database, {"dpo_iso": 1}) as bouncer:
        url = bouncer.url("dpo_iso")
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as plain:
            assert _show(plain) == "repeatable read"
            broker = brokers(url, listen=False, prepare_threshold=None)
            # Then the broker's statements run at READ COMMITTED, taking turns on that server
            # connection with a client at the default: each says its level (a session default set
            # on the shared server connection would reach the other client)
            for _ in range(3):
                with broker.runtime.connection() as conn:
                    assert conn.cursor_factory.__name__ == "ReadCommittedCursor"
                    assert _show(conn) == "read committed"
                    with conn.transaction():
                        assert _show(conn) == "read committed"
                assert _show(plain) == "repeatable read"
            # And the ring's call runs there
            assert Reclaimer(broker.runtime).run_once() is not None


def test_no_connection_of_the_package_is_opened_without_read_committed() -> None:
    import ast
    from pathlib import Path

    # Given every call in the package (and its alembic environment) that opens a connection or a pool
    root = Path(__file__).resolve().parent.parent
    files = [p for p in (root / "dramatiq_pg_outbox").rglob("*.py") if "testing" not in p.parts]
    files.append(root / "alembic" / "env.py")
    found: list[str] = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            keywords = {k.arg for k in node.keywords}
            where = f"{path.relative_to(root)}:{node.lineno} {name}"
            # Then none opens a bare psycopg connection (only _isolation.connect does, and sets it up),
            # every pool sets its connections up, and every engine names its isolation level
            if (
                name in ("psycopg.connect", "psycopg.Connection.connect", "psycopg.AsyncConnection.connect")
                and path.name != "_isolation.py"
            ):
                found.append(where)
            elif name == "ConnectionPool" and "connection_class" not in keywords:
                found.append(where)
            elif name == "AsyncConnectionPool" and "configure" not in keywords:
                found.append(where)
            elif name == "create_engine" and "isolation_level" not in keywords:
                found.append(where)
    assert found == []


def test_a_keyed_outbox_send_at_repeatable_read_never_stores_again_a_key_completed_after_its_snapshot(
    make_broker: Any, start_worker: Any, database_url: str
) -> None:
    from sqlalchemy.exc import DBAPIError

    broker = make_broker()
    runs: list[int] = []

    @dramatiq.actor(broker=broker, actor_name="iso_keyed")
    def iso_keyed(n: int) -> None:
        runs.append(n)

    engine = create_engine(normalize_sqlalchemy_url(database_url), isolation_level="REPEATABLE READ")
    try:
        with Session(engine) as session:
            # Given an application transaction at REPEATABLE READ whose snapshot is taken
            session.execute(text("SELECT 1"))
            # And a message with key K sent, run and completed after that snapshot
            iso_keyed.send_with_options(args=(1,), idempotency_key="iso-k")
            start_worker(broker)
            broker.join(iso_keyed.queue_name, timeout=10_000)
            # When the transaction sends with K through outbox() and commits
            try:
                with outbox(session):
                    iso_keyed.send_with_options(args=(2,), idempotency_key="iso-k")
                session.commit()
            except DBAPIError as e:  # a serialization error is allowed
                assert isinstance(e.orig, psycopg.errors.SerializationFailure), e
        broker.join(iso_keyed.queue_name, timeout=10_000)
    finally:
        engine.dispose()
    # Then K ran once
    assert runs == [1]
