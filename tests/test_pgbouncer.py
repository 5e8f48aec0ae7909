"""The broker, the outbox, results, periodic jobs and the relay through a real PgBouncer.

PgBouncer (Debian's package, 1.18 on Debian 12) runs in ``pool_mode = transaction``, started
on a free port for the session (``tests/pgbouncer.py``); without the binary these tests skip
with the install command.  Two database aliases point at the test database: ``dpo_pooled``
(4 server connections) and ``dpo_single`` (one server connection: every client's transactions
take turns on it, so anything that leaves state in a server session, such as a prepared
statement, meets the next client deterministically).  Two more, for the listener's probe
(``_runtime.listener.probe_listen``): ``dpo_session`` in ``pool_mode = session`` and
``dpo_statement`` in ``pool_mode = statement``.  The guide docs/guides/pgbouncer.md names
these tests.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox, upgrade
from dramatiq_pg_outbox._isolation import connect
from dramatiq_pg_outbox._runtime.listener import listen_probe, probe_listen, subscribe
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.relay import Relay

from .helpers import LISTENERS, count, reachable, wait_for
from .pgbouncer import PGBOUNCER_MISSING, PgBouncer, pgbouncer_binary

ROOT = Path(__file__).resolve().parent.parent
REDIS = os.environ.get("DPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

#: The settings of the PgBouncer guide (docs/guides/pgbouncer.md).
BEHIND_PGBOUNCER: dict[str, Any] = {"listen": False, "prepare_threshold": None}


@pytest.fixture(scope="session")
def pgbouncer(database_url: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode in front of the test database, for the session."""
    if pgbouncer_binary() is None:
        pytest.skip(PGBOUNCER_MISSING)
    databases = {"dpo_pooled": 4, "dpo_single": 1, "dpo_session": 20, "dpo_statement": 2}
    modes = {"dpo_session": "session", "dpo_statement": "statement"}
    with PgBouncer(database_url, databases, pool_modes=modes) as bouncer:
        yield bouncer


@pytest.fixture
def pooled_url(pgbouncer: PgBouncer) -> str:
    return pgbouncer.url("dpo_pooled")


@pytest.fixture
def single_url(pgbouncer: PgBouncer) -> str:
    return pgbouncer.url("dpo_single")


@pytest.fixture
def session_url(pgbouncer: PgBouncer) -> str:
    return pgbouncer.url("dpo_session")


@pytest.fixture
def servers_closed_after(pgbouncer: PgBouncer) -> Iterator[None]:
    """Closes PgBouncer's server connections after the test (requested before ``make_broker``).

    PgBouncer keeps each client's ``application_name`` on the server connection it last
    ran (``dramatiq-pg-outbox:<pid>:listen``, ``...:probe``): left idle there, other tests
    of the database that count the package's LISTEN connections would see them.
    """
    yield
    with psycopg.connect(pgbouncer.admin_url(), autocommit=True) as admin:
        for alias in pgbouncer.databases:
            admin.execute(f"KILL {alias}")
            admin.execute(f"RESUME {alias}")
        wait_for(
            lambda: not admin.execute("SHOW SERVERS").fetchall(),
            10,
            "PgBouncer's server connections to close",
        )


def own(url: str) -> str:
    """``url`` with an application_name of its own: a process keeps one probe verdict per URL."""
    return f"{url}?application_name=pgb_probe_{uuid.uuid4().hex[:8]}"


def engine_behind_pgbouncer(url: str) -> Engine:
    """The application's SQLAlchemy engine through PgBouncer: psycopg prepares nothing."""
    return create_engine(normalize_sqlalchemy_url(url), connect_args={"prepare_threshold": None})


# -- what breaks in transaction pooling, and why the settings ---------------------------------


def test_psycopgs_default_prepared_statements_collide_on_a_shared_server_connection(
    single_url: str,
) -> None:
    # Given two clients with psycopg's default prepare_threshold (5), through one server connection
    with (
        psycopg.connect(single_url, autocommit=True) as first,
        psycopg.connect(single_url, autocommit=True) as second,
    ):
        # When the first runs a statement often enough for psycopg to prepare it ("_pg3_0")
        for i in range(8):
            first.execute("SELECT %s::int", (i,))
        # Then the second's own "_pg3_0" meets it on the server connection they take turns on
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
            for i in range(8):
                second.execute("SELECT %s::int", (i,))


def test_a_broker_with_prepare_threshold_none_sends_and_consumes_through_one_server_connection(
    single_url: str, db: Any, make_broker: Any, start_worker: Any
) -> None:
    # Given a producer broker and a consuming broker, both through one server connection
    producer = make_broker(single_url, **BEHIND_PGBOUNCER)
    consumer = make_broker(single_url, **BEHIND_PGBOUNCER)
    ran: list[int] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        with lock:
            ran.append(i)

    dramatiq.actor(run, broker=producer, actor_name="pgb_run", queue_name="pgb")
    dramatiq.actor(run, broker=consumer, actor_name="pgb_run", queue_name="pgb")
    start_worker(consumer)
    # When 30 messages are sent one statement each (each statement runs far more than 5 times)
    for i in range(30):
        producer.get_actor("pgb_run").send(i)
    # Then every message ran once and nothing is left: no statement was prepared on the server
    wait_for(lambda: len(ran) == 30, 30, "the 30 messages to run")
    producer.join("pgb", timeout=10_000)
    assert sorted(ran) == list(range(30))
    assert producer.prepare_threshold is None
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'completed'") == 30


def test_a_listen_through_transaction_pooling_hears_nothing_its_notification_reaches_another_client(
    single_url: str, database_url: str
) -> None:
    heard: list[str] = []
    stray: list[str] = []
    with (
        psycopg.connect(single_url, autocommit=True, prepare_threshold=None) as listener,
        psycopg.connect(single_url, autocommit=True, prepare_threshold=None) as other,
        psycopg.connect(database_url, autocommit=True) as direct,
    ):
        listener.add_notify_handler(lambda n: heard.append(n.payload))
        other.add_notify_handler(lambda n: stray.append(n.payload))
        # Given a LISTEN sent through PgBouncer: it ran on the server connection, then gave it back
        listener.execute("LISTEN dpo_pgbouncer_test")
        # And another client in a transaction on that server connection
        other.execute("BEGIN")
        other.execute("SELECT 1")
        # When a NOTIFY commits, delivered once that transaction ends
        direct.execute("NOTIFY dpo_pgbouncer_test, 'wake up'")
        other.execute("COMMIT")
        listener.execute("SELECT 1")
        # (The server connection keeps the LISTEN until told otherwise, whoever holds it next.)
        listener.execute("UNLISTEN *")
    # Then the other client got the notification and the listener nothing
    assert stray == ["wake up"]
    assert heard == []


# -- the listener's probe: LISTEN through a pooler that shares server connections ---------------

#: What identifies the listener's warning (``_runtime.listener.SHARED_WARNING``).
SHARED = "LISTEN cannot work through"


def shared_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(SHARED)]


def test_a_listen_hears_its_own_notify_through_transaction_pooling_by_chance(
    servers_closed_after: None, single_url: str
) -> None:
    # Given a client through transaction pooling with one server connection, listening
    channel = f"pgb_chance_{uuid.uuid4().hex[:8]}"
    with (
        psycopg.connect(single_url, autocommit=True, prepare_threshold=None) as listener,
        psycopg.connect(single_url, autocommit=True, prepare_threshold=None) as other,
    ):
        listener.execute(f"LISTEN {channel}")
        # When it NOTIFYs its own channel, its transaction runs on the server connection of the LISTEN
        listener.execute(f"NOTIFY {channel}, 'self'")
        # Then it hears it (a probe that notified itself would pass)
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == ["self"]
        # While another client's NOTIFY, sent while the listener is idle, does not reach it
        other.execute(f"NOTIFY {channel}, 'other'")
        assert [n.payload for n in listener.notifies(timeout=0.5)] == []
        listener.execute(f"UNLISTEN {channel}")


@pytest.mark.parametrize(
    ("alias", "found"),
    [
        (None, "direct"),
        ("dpo_session", "session"),
        ("dpo_single", "shared"),
        ("dpo_pooled", "shared"),
        ("dpo_statement", "shared"),
    ],
)
def test_the_listen_probe_tells_a_direct_server_session_pooling_and_shared_server_connections_apart(
    servers_closed_after: None, alias: str | None, found: str, pgbouncer: PgBouncer, database_url: str
) -> None:
    url = database_url if alias is None else pgbouncer.url(alias)
    # Given a connection made as the listener makes it, through PgBouncer in each pool mode or direct
    for _ in range(3):
        with connect(url, autocommit=True, prepare_threshold=None) as conn:
            # When it probes, three times (with one server connection or a quiet pool, the second
            # connection's NOTIFY runs on the server connection of the probe's LISTEN)
            # Then it finds what the pool mode says
            assert probe_listen(conn, url) == found
            # And its probe channel is not listened to on the connection it runs on now
            assert conn.execute("SELECT count(*) FROM pg_listening_channels()").fetchone() == (0,)


def test_the_listen_probe_finds_transaction_pooling_when_its_notification_reaches_an_idle_server_connection(
    database_url: str,
) -> None:
    if pgbouncer_binary() is None:
        pytest.skip(PGBOUNCER_MISSING)
    # Given transaction pooling that hands out the idle server connection used least recently
    # (server_round_robin), with 4 server connections open: the probe's NOTIFY runs on another
    # server connection than its LISTEN, which idles in the pool meanwhile
    with PgBouncer(database_url, {"dpo_rr": 4}, {"server_round_robin": 1}) as bouncer:
        url = bouncer.url("dpo_rr")
        clients = [psycopg.connect(url, autocommit=True) for _ in range(4)]
        try:
            for client in clients:
                client.execute("BEGIN")
                client.execute("SELECT 1")
            for client in clients:
                client.execute("COMMIT")
        finally:
            for client in clients:
                client.close()
        # When the listener's probe runs
        with connect(url, autocommit=True, prepare_threshold=None) as conn:
            found = probe_listen(conn, url)
        # Then it finds transaction pooling: nobody heard the notification, PgBouncer dropped it
        assert found == "shared"
        assert "got packet 'A' from server when not linked" in bouncer.log()


@pytest.mark.parametrize("alias", ["dpo_single", "dpo_pooled"])
def test_a_worker_behind_transaction_pooling_warns_once_listens_to_nothing_and_polls(
    servers_closed_after: None,
    alias: str,
    pgbouncer: PgBouncer,
    database_url: str,
    make_broker: Any,
    start_worker: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    url = own(pgbouncer.url(alias))
    # Given a worker through transaction pooling with listen left on (the default)
    consumer = make_broker(url, prepare_threshold=None)
    queue = f"pgb_probe_{uuid.uuid4().hex[:8]}"
    ran: list[int] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        with lock:
            ran.append(i)

    dramatiq.actor(run, broker=consumer, actor_name="pgb_probe", queue_name=queue)
    start_worker(consumer)
    # When its listener starts (and probes)
    wait_for(lambda: consumer.runtime.listener is not None, 10, "the worker to subscribe")
    subscription = consumer.runtime.listener
    wait_for(subscription.settled.is_set, 10, "the listener's probe")
    # Then it found server connections shared, listens to nothing, and said so in one warning line
    assert listen_probe(consumer.conninfo) == "shared"
    assert subscription.listener.shared and not subscription.connected.is_set()
    # naming the setting
    [warning] = shared_warnings(caplog)
    assert "listen=False" in warning and "\n" not in warning
    # And a second subscriber of the process (a result waiter, the relay) gets no second warning
    again = subscribe(consumer.conninfo, f"{queue}_results", lambda _: None, lambda: None)
    assert again.settled.is_set() and not again.connected.is_set()
    again.close()
    assert len(shared_warnings(caplog)) == 1
    # And no server connection was left listening to the broker's channel: a client in a
    # transaction on it (the only one, with dpo_single) gets no notification of the broker's,
    # committed meanwhile (directly: the one server connection is the bystander's)
    stray: list[str] = []
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as bystander:
        bystander.add_notify_handler(lambda n: stray.append(n.payload))
        with bystander.transaction():
            bystander.execute("SELECT 1")
            with psycopg.connect(database_url, autocommit=True) as direct:
                direct.execute("SELECT pg_notify(%s, %s)", (consumer.channel, queue))
        bystander.execute("SELECT 1")
    assert stray == []
    # And the messages sent meanwhile all run, by polling
    producer = make_broker(url, prepare_threshold=None, listen=False)
    dramatiq.actor(run, broker=producer, actor_name="pgb_probe", queue_name=queue)
    for i in range(10):
        producer.get_actor("pgb_probe").send(i)
    wait_for(lambda: len(ran) == 10, 30, "the 10 messages to run")
    assert sorted(ran) == list(range(10))
    assert len(shared_warnings(caplog)) == 1


def test_a_worker_behind_session_pooling_keeps_listening_and_is_woken_by_notifications(
    servers_closed_after: None,
    session_url: str,
    make_broker: Any,
    start_worker: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    url = own(session_url)
    # Given a worker through session pooling that polls only once a minute
    consumer = make_broker(url, prepare_threshold=None, max_fetch_interval=60_000)
    queue = f"pgb_session_{uuid.uuid4().hex[:8]}"
    ran = threading.Event()
    dramatiq.actor(lambda: ran.set(), broker=consumer, actor_name="pgb_session", queue_name=queue)
    start_worker(consumer)
    wait_for(lambda: consumer.runtime.listener is not None, 10, "the worker to subscribe")
    subscription = consumer.runtime.listener
    # When its listener has probed
    wait_for(subscription.connected.is_set, 10, "the worker's LISTEN")
    # Then it found its server connection its own, and listens, with no warning
    assert listen_probe(consumer.conninfo) == "session"
    assert not subscription.listener.shared
    assert shared_warnings(caplog) == []
    # And a message sent then is claimed on its notification, not at the next poll
    producer = make_broker(url, prepare_threshold=None, listen=False)
    dramatiq.actor(lambda: None, broker=producer, actor_name="pgb_session", queue_name=queue)
    producer.get_actor("pgb_session").send()
    wait_for(lambda: subscription.received >= 1, 30, "the notification")
    assert ran.wait(30)


def test_listen_false_behind_transaction_pooling_neither_probes_nor_warns(
    single_url: str, make_broker: Any, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    url = own(single_url)
    # Given a worker through transaction pooling with listen=False
    consumer = make_broker(url, **BEHIND_PGBOUNCER)
    queue = f"pgb_nolisten_{uuid.uuid4().hex[:8]}"
    ran = threading.Event()
    dramatiq.actor(lambda: ran.set(), broker=consumer, actor_name="pgb_nolisten", queue_name=queue)
    start_worker(consumer)
    # When a message is sent and runs (by polling)
    consumer.get_actor("pgb_nolisten").send()
    assert ran.wait(30)
    # Then no listener was started, nothing probed, nothing said
    assert consumer.runtime.listener is None
    assert listen_probe(consumer.conninfo) is None
    assert shared_warnings(caplog) == []


# -- everything through PgBouncer with listen=False, prepare_threshold=None ----------------------


@pytest.fixture
def app(single_url: str, database_url: str, db: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """tests/pgbouncer_app.py in the test process (to send and read results), through PgBouncer."""
    monkeypatch.setenv("DPO_PGBOUNCER_URL", single_url)
    monkeypatch.setenv("DPO_TEST_URL", database_url)
    db.execute("CREATE TABLE IF NOT EXISTS pgb_orders (key text PRIMARY KEY)")
    db.execute("TRUNCATE pgb_orders")
    from tests import pgbouncer_app

    dramatiq.set_broker(pgbouncer_app.broker)
    yield pgbouncer_app
    pgbouncer_app.broker.close()


def test_a_worker_process_behind_pgbouncer_runs_outbox_messages_retries_results_and_periodic_jobs(
    app: Any, single_url: str, db: Any, tmp_path: Path
) -> None:
    # Given a `dramatiq` worker process whose broker reaches PostgreSQL only through PgBouncer
    # (one server connection), with listen=False and prepare_threshold=None
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "tests.pgbouncer_app", "--processes", "1", "--threads", "4"],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    engines = [engine_behind_pgbouncer(single_url), engine_behind_pgbouncer(single_url)]
    try:
        # When two engines' sessions, taking turns, send through outbox() through PgBouncer:
        # 12 commit, 4 roll back
        committed, rolled_back = set(), set()
        for i in range(16):
            key = f"order-{i}"
            with Session(engines[i % 2]) as session, outbox(session):
                session.execute(text("INSERT INTO pgb_orders VALUES (:k)"), {"k": key})
                app.record.send(key)
                if i % 4 == 3:
                    session.rollback()
                    rolled_back.add(key)
                else:
                    session.commit()
                    committed.add(key)
        # And a message that fails once (its retry is written with its ack), and one whose result is read
        app.fail_once.send("flaky")
        result = app.add.send(2, 3).get_result(block=True, timeout=30_000)

        def runs() -> dict[str, int]:
            return dict(db.execute("SELECT key, n FROM received").fetchall())

        # Then each committed message ran once, none rolled back; the retry ran; the result came back
        wait_for(lambda: committed <= runs().keys() and runs().get("flaky") == 2, 30, "the messages to run")
        assert result == 5
        assert {k: n for k, n in runs().items() if k.startswith("order-")} == dict.fromkeys(committed, 1)
        # And the worker's scheduler enqueued periodic ticks, each run once
        wait_for(lambda: sum(k.startswith("tick:") for k in runs()) >= 2, 30, "two periodic ticks")
        assert all(n == 1 for k, n in runs().items() if k.startswith("tick:"))
        # And the worker heartbeats, and no LISTEN reached the server
        assert count(db, "SELECT count(*) FROM dramatiq.workers") == 1
        assert count(db, LISTENERS) == 0
    finally:
        worker.terminate()
        worker.wait(30)
        for engine in engines:
            engine.dispose()
    assert worker.returncode == 0
    # And no statement of the worker's loops (claims, flushes, heartbeats, reclaims, the scheduler)
    # failed on a prepared statement: with psycopg's default threshold, they do, and are retried
    assert "prepared statement" not in log_path.read_text(errors="replace")


def test_producers_through_pgbouncer_wake_a_worker_that_listens_on_a_direct_connection(
    pooled_url: str, database_url: str, db: Any, make_broker: Any, start_worker: Any
) -> None:
    # Given a worker whose broker connects directly and listens, polling only once a minute
    consumer = make_broker(database_url, max_fetch_interval=60_000)
    ran = threading.Event()
    dramatiq.actor(lambda: ran.set(), broker=consumer, actor_name="pgb_wake", queue_name="pgb_wake")
    start_worker(consumer)
    wait_for(lambda: consumer.runtime.listener is not None, 10, "the worker to subscribe")
    listening = consumer.runtime.listener
    wait_for(listening.connected.is_set, 10, "the worker's LISTEN")
    # And a producer that sends through PgBouncer with NOTIFY in its transaction
    producer = make_broker(pooled_url, prepare_threshold=None, listen=False, notify="transaction")
    dramatiq.actor(lambda: None, broker=producer, actor_name="pgb_wake", queue_name="pgb_wake")
    engine = engine_behind_pgbouncer(pooled_url)
    try:
        # When it sends inside outbox() and commits
        with Session(engine) as session, outbox(session, producer):
            producer.get_actor("pgb_wake").send()
            session.commit()
        # Then the worker's LISTEN connection heard it, and the message ran
        wait_for(lambda: listening.received >= 1, 30, "the notification")
        assert ran.wait(30)
        # (and its listener's probe found a direct connection: nothing to fall back from)
        assert listen_probe(consumer.conninfo) == "direct"
    finally:
        engine.dispose()


def test_the_relay_moves_the_outbox_to_redis_through_pgbouncer(
    pooled_url: str, db: Any, make_broker: Any
) -> None:
    redis = pytest.importorskip("redis", reason="the relay test needs redis (pip install 'dramatiq[redis]')")
    from dramatiq.brokers.redis import RedisBroker

    if not reachable("127.0.0.1", 6379):
        pytest.skip("no Redis server at 127.0.0.1:6379")
    # Given a broker and a relay to Redis through PgBouncer, listen=False, prepare_threshold=None
    broker = make_broker(pooled_url, **BEHIND_PGBOUNCER)
    queue = f"pgb_relay_{uuid.uuid4().hex[:8]}"
    dramatiq.actor(lambda key: None, broker=broker, actor_name="pgb_relayed", queue_name=queue)
    target = RedisBroker(url=REDIS, namespace=f"dpo-test-{queue}")
    client = redis.Redis.from_url(REDIS)
    relay = Relay(broker, target, [queue], batch_size=4)
    engine = engine_behind_pgbouncer(pooled_url)
    try:
        # When 20 messages are sent through the outbox and the relay runs batches of 4
        for i in range(20):
            with Session(engine) as session, outbox(session, broker):
                broker.get_actor("pgb_relayed").send(f"k{i}")
                session.commit()
        while relay.run_once():
            pass
        # Then Redis holds the 20 messages and PostgreSQL archived them
        assert relay.stats.relayed == 20
        assert client.hlen(f"dpo-test-{queue}:{queue}.msgs") == 20
        assert count(db, "SELECT count(*) FROM dramatiq.messages") == 0
        assert count(db, "SELECT count(*) FROM dramatiq.history WHERE queue_name = %s", (queue,)) == 20
    finally:
        engine.dispose()
        target.close()
        keys = list(client.scan_iter(f"dpo-test-{queue}*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_rate_limiters_and_a_barrier_work_through_pgbouncer_with_transaction_scoped_locks(
    single_url: str, db: Any, make_broker: Any
) -> None:
    from dramatiq.rate_limits import Barrier, ConcurrentRateLimiter, WindowRateLimiter

    from dramatiq_pg_outbox.rate_limits import PostgresBackend

    db.execute("TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events")
    key = f"pgb-{uuid.uuid4().hex[:8]}"
    # Given two processes' backends (two brokers) through one server connection, listen=False
    brokers = [make_broker(single_url, **BEHIND_PGBOUNCER) for _ in range(2)]
    first, second = (PostgresBackend(broker=broker, poll_interval=100) for broker in brokers)
    # When they take turns on a window limiter of 3 (its sum takes an advisory lock per key,
    # transaction-scoped) and on a mutex
    window = [WindowRateLimiter(backend, f"{key}-window", limit=3, window=60) for backend in (first, second)]
    admitted = 0
    for i in range(8):
        with window[i % 2].acquire(raise_on_failure=False) as acquired:
            admitted += bool(acquired)
    mutex = [ConcurrentRateLimiter(backend, f"{key}-mutex", limit=1) for backend in (first, second)]
    with mutex[0].acquire(raise_on_failure=False) as held:
        with mutex[1].acquire(raise_on_failure=False) as also_held:
            assert held and not also_held
    with mutex[1].acquire(raise_on_failure=False) as held_after:
        assert held_after
    # Then the window admitted exactly 3; and a barrier released through one backend is seen
    # by a waiter on the other, by polling
    assert admitted == 3
    barrier = Barrier(first, f"{key}-barrier", ttl=60_000)
    barrier.create(parties=1)
    assert barrier.wait(block=False) is True
    assert Barrier(second, f"{key}-barrier", ttl=60_000).wait(timeout=10_000) is True


def test_the_pgbouncer_guide_snippet_runs_as_written(single_url: str, db: Any) -> None:
    guide = (ROOT / "docs" / "guides" / "pgbouncer.md").read_text()
    code = guide.split("```python\n", 1)[1].split("```", 1)[0]
    # Only the example's URLs change (to the test database through PgBouncer): the code runs as printed.
    alias = make_url(single_url).database
    assert alias is not None
    code = code.replace("app@pgbouncer:6432/app", single_url.split("://", 1)[1])
    previous = dramatiq.get_broker()
    namespace: dict[str, Any] = {"__name__": "readme_pgbouncer"}
    exec(compile(code, "docs/guides/pgbouncer.md", "exec", dont_inherit=True), namespace)
    broker, results, engine = namespace["broker"], namespace["results"], namespace["engine"]
    try:
        assert make_url(broker.conninfo).database == alias and engine.url.database == alias
        actor = dramatiq.actor(lambda: None, broker=broker, actor_name="pgb_readme", queue_name="pgb_readme")
        # When two connections of the engine take turns sending through outbox(), 8 times each
        with engine.connect() as first, engine.connect() as second:
            for _ in range(8):
                for conn in (first, second):
                    with conn.begin(), outbox(conn, broker):
                        actor.send()
        # And the results backend stores and reads a result as often
        message = actor.message()
        for i in range(8):
            results.store_result(message, i, 60_000)
            assert results.get_result(message) == i
        # Then every message is stored
        assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'pgb_readme'") == 16
    finally:
        engine.dispose()
        broker.close()
        dramatiq.set_broker(previous)


# -- migrations and two-phase transactions ------------------------------------------------------


@pytest.fixture(scope="module")
def twophase_server() -> Iterator[str]:
    """A throwaway server that allows prepared transactions (the shared one has none)."""
    from dramatiq_pg_outbox.testing import ThrowawayPostgres

    if pgbouncer_binary() is None:
        pytest.skip(PGBOUNCER_MISSING)
    try:
        server = ThrowawayPostgres({"max_prepared_transactions": 4})
    except RuntimeError as e:
        pytest.skip(f"cannot start a PostgreSQL server that allows prepared transactions: {e}")
    with server:
        yield server.url_for("postgres")


def test_migrations_and_a_two_phase_outbox_transaction_work_through_pgbouncer(twophase_server: str) -> None:
    with PgBouncer(twophase_server, {"dpo_2pc": 2}) as bouncer:
        url = bouncer.url("dpo_2pc")
        # Given the schema created through PgBouncer (one transaction, a transaction-scoped lock)
        upgrade(url)
        broker = PostgresBroker(url=url, **BEHIND_PGBOUNCER)
        dramatiq.actor(lambda: None, broker=broker, actor_name="pgb_2pc", queue_name="pgb_2pc")
        engine = engine_behind_pgbouncer(url)
        try:
            with engine.connect() as conn:
                conn.execute(text("CREATE TABLE accounts (name text)"))
                conn.commit()
            # When a message is sent in a two-phase transaction, prepared then committed
            with engine.connect() as conn:
                twophase = conn.begin_twophase()
                with outbox(conn, broker):
                    conn.execute(text("INSERT INTO accounts VALUES ('ada')"))
                    broker.get_actor("pgb_2pc").send()
                twophase.prepare()
                twophase.commit()
            # Then the message and the row are stored, and no prepared transaction is left
            with psycopg.connect(twophase_server, autocommit=True) as direct:
                stored = "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'pgb_2pc'"
                assert count(direct, stored) == 1
                assert count(direct, "SELECT count(*) FROM accounts") == 1
                assert count(direct, "SELECT count(*) FROM pg_prepared_xacts") == 0
                assert make_url(url).port != make_url(twophase_server).port
        finally:
            engine.dispose()
            broker.close()


def test_prepare_threshold_in_the_url_is_refused_at_construction_naming_the_broker_option() -> None:
    # Given a URL carrying prepare_threshold, which libpq refuses at every connection attempt
    url = "postgresql://app:s3cret@127.0.0.1:1/app?prepare_threshold=0"
    # Then the broker refuses it at once, in one line that names the option and hides the password
    with pytest.raises(ValueError) as excinfo:
        PostgresBroker(url=url)
    message = str(excinfo.value)
    assert 'invalid URI query parameter: "prepare_threshold"' in message
    assert "PostgresBroker(url=..., prepare_threshold=None)" in message
    assert "s3cret" not in message and "\n" not in message
