"""URLs naming several hosts (a primary and a standby): libpq's ``h1:p1,h2:p2`` and SQLAlchemy's
``?host=h1:p1&host=h2:p2``, with ``target_session_attrs=read-write``.

The real-server tests list, in this order: a port nothing listens on, a throwaway server in
read-only mode (``default_transaction_read_only=on``, which libpq's read-write check reads, as on a
hot standby) holding a database of the same name, and the test server. Each checks that the
broker, its workers (in-process and the ``dramatiq`` CLI), ``outbox()`` sessions, the operator CLI,
the metrics exporter and the dashboard's store reach the test server.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox, upgrade
from dramatiq_pg_outbox._jdbc import jdbc_options
from dramatiq_pg_outbox.dashboard.store import Store
from dramatiq_pg_outbox.metrics import DatabaseCollector
from dramatiq_pg_outbox.spark.options import given_options
from dramatiq_pg_outbox.testing import ThrowawayPostgres
from dramatiq_pg_outbox.testing.binaries import free_port
from dramatiq_pg_outbox.urls import URLError, libpq_url, mask_password, normalize_sqlalchemy_url, safe_url

from .conftest import ROOT, WorkerProcess
from .helpers import count, wait_for

FORMS = ("libpq", "sqlalchemy")
PASSWORD = "S3cret-pw"


def multi_host_url(
    form: str, servers: list[tuple[str, int]], user: str, database: str, password: str = ""
) -> str:
    """A URL naming ``servers`` in order, in libpq's form or SQLAlchemy's, with read-write."""
    credentials = f"{user}:{password}" if password else user
    if form == "libpq":
        hosts = ",".join(f"{host}:{port}" for host, port in servers)
        return f"postgresql://{credentials}@{hosts}/{database}?target_session_attrs=read-write"
    hosts = "&".join(f"host={host}:{port}" for host, port in servers)
    return f"postgresql+psycopg://{credentials}@/{database}?{hosts}&target_session_attrs=read-write"


# -- the forms, as libpq, SQLAlchemy's dialect and pgjdbc get them ---------------------------


@pytest.mark.parametrize("form", FORMS)
def test_both_forms_reach_libpq_as_two_hosts_with_their_ports(form: str) -> None:
    url = multi_host_url(form, [("10.0.0.1", 5433), ("10.0.0.2", 5434)], "app", "db", PASSWORD)
    params = conninfo_to_dict(libpq_url(url))
    assert params["host"] == "10.0.0.1,10.0.0.2"
    assert params["port"] == "5433,5434"
    assert params["target_session_attrs"] == "read-write"
    assert (params["user"], params["password"], params["dbname"]) == ("app", PASSWORD, "db")


@pytest.mark.parametrize(
    ("url", "hosts", "ports"),
    [
        # a host without a port takes the default one
        ("postgresql://app@a,b:5434/db", "a,b", ",5434"),
        # an IPv6 address in brackets, a %-encoded socket directory
        ("postgresql://app@[::1]:5433,%2Frun%2Fpostgresql:5434/db", "::1,/run/postgresql", "5433,5434"),
        # SQLAlchemy's lists, as they were
        ("postgresql://app@/db?host=a,b&port=5433,5434", "a,b", "5433,5434"),
        # SQLAlchemy's one ?host=name:port
        ("postgresql+psycopg://app@/db?host=a:5433", "a", "5433"),
    ],
)
def test_host_lists_keep_each_host_with_its_port(url: str, hosts: str, ports: str) -> None:
    params = conninfo_to_dict(libpq_url(url))
    assert (params["host"], params["port"]) == (hosts, ports)


@pytest.mark.parametrize("form", FORMS)
def test_sqlalchemys_psycopg_dialect_gets_both_hosts_from_either_form(form: str) -> None:
    url = multi_host_url(form, [("10.0.0.1", 5433), ("10.0.0.2", 5434)], "app", "db", PASSWORD)
    engine = create_engine(normalize_sqlalchemy_url(url))
    try:
        _, params = engine.dialect.create_connect_args(engine.url)
    finally:
        engine.dispose()
    assert (params["host"], params["port"]) == ("10.0.0.1,10.0.0.2", "5433,5434")
    assert params["target_session_attrs"] == "read-write"
    assert params["password"] == PASSWORD


@pytest.mark.parametrize("form", FORMS)
def test_the_password_of_either_form_is_masked(form: str) -> None:
    url = multi_host_url(form, [("10.0.0.1", 5433), ("10.0.0.2", 5434)], "app", "db", PASSWORD)
    with_query_secret = f"{url}&sslpassword=key-S3cret"
    for shown in (
        mask_password(with_query_secret),
        safe_url(normalize_sqlalchemy_url(with_query_secret)),
        repr(PostgresBroker(url=with_query_secret)),
    ):
        assert PASSWORD not in shown and "key-S3cret" not in shown
        assert "app:***@" in shown and "sslpassword=***" in shown
    # mask_password keeps the rest of the URL as written
    assert mask_password(url) == url.replace(PASSWORD, "***")


@pytest.mark.parametrize("form", FORMS)
def test_the_jdbc_url_lists_both_servers_and_asks_for_the_primary(form: str) -> None:
    url = multi_host_url(form, [("10.0.0.1", 5433), ("10.0.0.2", 5434)], "app", "db", PASSWORD)
    options = jdbc_options(url)
    assert options["url"].startswith("jdbc:postgresql://10.0.0.1:5433,10.0.0.2:5434/db?")
    assert "targetServerType=primary" in options["url"]
    assert PASSWORD not in options["url"] and options["password"] == PASSWORD


def test_an_ipv6_host_list_becomes_bracketed_jdbc_servers() -> None:
    options = jdbc_options("postgresql://app@[::1]:5433,[fe80::2]:5434/db?target_session_attrs=read-write")
    assert options["url"].startswith("jdbc:postgresql://[::1]:5433,[fe80::2]:5434/db?")


@pytest.mark.parametrize("form", FORMS)
def test_the_spark_sources_url_option_takes_either_form(form: str) -> None:
    url = multi_host_url(form, [("10.0.0.1", 5433), ("10.0.0.2", 5434)], "app", "db", PASSWORD)
    _, conninfo, _ = given_options({"url": url}, "dramatiq", ["url"], ["url"])
    params = conninfo_to_dict(conninfo)
    assert (params["host"], params["port"], params["target_session_attrs"]) == (
        "10.0.0.1,10.0.0.2",
        "5433,5434",
        "read-write",
    )


# -- bad input: one line, what is wrong, no password ------------------------------------------

MALFORMED = [
    (f"postgresql://app:{PASSWORD}@a:5433,:5434/db", "the entry ':5434' of its host list has no host"),
    (f"postgresql://app:{PASSWORD}@a:5433,b:x/db", "the port 'x' of 'b:x' is not a number"),
    (f"postgresql://app:{PASSWORD}@a:5433,,b/db", "the entry '' of its host list has no host"),
    (f"postgresql://app:{PASSWORD}@a:5433,b:5434/db?port=5435", "names its hosts twice"),
    (f"postgresql+psycopg://app:{PASSWORD}@/db?host=a:5433&host=b:5434&port=5435", "a ?port= too"),
    (f"postgresql+psycopg://app:{PASSWORD}@/db?host=a:5433&host=b:x", "?host=b:x, which is not HOST"),
]


@pytest.mark.parametrize(("url", "says"), MALFORMED)
def test_a_malformed_host_list_is_refused_in_one_line_without_the_password(url: str, says: str) -> None:
    for call in (libpq_url, normalize_sqlalchemy_url, lambda u: PostgresBroker(url=u), jdbc_options):
        with pytest.raises(URLError) as raised:
            call(url)
        message = str(raised.value)
        assert says in message and "\n" not in message
        assert PASSWORD not in message and "app:***@" in message


def test_the_spark_sources_name_the_url_option_of_a_malformed_host_list() -> None:
    url, says = MALFORMED[1]
    with pytest.raises(ValueError, match=r"^option 'url': cannot read the hosts") as raised:
        given_options({"url": url}, "dramatiq", ["url"], ["url"])
    assert says in str(raised.value) and PASSWORD not in str(raised.value)


def cli_status(url: str) -> subprocess.CompletedProcess[str]:
    """``dramatiq-pg-outbox status --url URL`` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_outbox.cli", "status", "--url", url],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(("url", "says"), MALFORMED[:2])
def test_the_cli_reports_a_malformed_host_list_as_a_usage_error(url: str, says: str) -> None:
    result = cli_status(url)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and PASSWORD not in result.stderr + result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith("dramatiq-pg-outbox status: error: --url: cannot read the hosts"), line
    assert says in line, line


# -- real servers: a dead port, a read-only server, the test server -------------------------


@pytest.fixture(scope="module")
def servers(database_url: str) -> Iterator[dict[str, Any]]:
    """The test server's login, and a list of servers of which only the last accepts writes."""
    params = conninfo_to_dict(database_url)
    host, port = str(params.get("host") or ""), int(params.get("port") or 5432)
    if not host or host.startswith("/") or "," in host:
        pytest.skip("the test server is not reached over TCP at one host")
    try:
        read_only = ThrowawayPostgres()
    except RuntimeError as e:
        pytest.skip(f"no local PostgreSQL binaries for a read-only server: {e}")
    database = str(params["dbname"])
    with read_only:
        with psycopg.connect(read_only.url, autocommit=True) as conn:
            # The same database name, so that only read-write can tell the servers apart.
            conn.execute(f'CREATE DATABASE "{database}"')
            conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            conn.execute("SELECT pg_reload_conf()")
        ro_port = int(conninfo_to_dict(read_only.url)["port"] or 0)
        yield {
            "list": [("127.0.0.1", free_port()), ("127.0.0.1", ro_port), (host, port)],
            "user": str(params.get("user") or "postgres"),
            "password": str(params.get("password") or ""),
            "database": database,
            "port": port,
            "read_only_port": ro_port,
        }


def url_of(servers: dict[str, Any], form: str) -> str:
    return multi_host_url(form, servers["list"], servers["user"], servers["database"], servers["password"])


def test_read_write_is_what_skips_the_read_only_server(servers: dict[str, Any]) -> None:
    url = libpq_url(url_of(servers, "libpq"))
    # Without target_session_attrs, libpq takes the read-only server (the first that answers)
    with psycopg.connect(url.replace("target_session_attrs=read-write", "target_session_attrs=any")) as conn:
        assert conn.info.port == servers["read_only_port"]
        assert conn.execute("SHOW transaction_read_only").fetchone() == ("on",)
    # With read-write, the test server
    with psycopg.connect(url) as conn:
        assert conn.info.port == servers["port"]


@pytest.mark.parametrize("form", FORMS)
def test_a_broker_enqueues_and_its_worker_processes_through_a_multi_host_url(
    form: str, servers: dict[str, Any], make_broker: Any, start_worker: Any, db: Any
) -> None:
    broker = make_broker(url=url_of(servers, form))
    key = f"multi-{form}-{secrets.token_hex(4)}"

    @dramatiq.actor(broker=broker, queue_name=f"multi_host_{form}", actor_name=f"multi_host_{form}")
    def remember(key: str) -> None:
        db.execute("INSERT INTO received (key, n, pids) VALUES (%s, 1, '{}')", (key,))

    remember.send(key)
    start_worker(broker)
    wait_for(
        lambda: count(db, "SELECT count(*) FROM received WHERE key = %s", (key,)) == 1, 30, "the message run"
    )
    with broker.runtime.connection() as conn:
        assert conn.info.port == servers["port"]


@pytest.mark.parametrize("form", FORMS)
def test_outbox_commits_a_row_and_its_message_through_an_engine_of_a_multi_host_url(
    form: str, servers: dict[str, Any], make_broker: Any, start_worker: Any, db: Any
) -> None:
    url = url_of(servers, form)
    broker = make_broker(url=url)
    queue = f"multi_outbox_{form}"

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=queue)
    def confirm(key: str) -> None:
        db.execute("UPDATE received SET n = n + 1 WHERE key = %s", (key,))

    # SQLAlchemy's own form goes to create_engine as it is; libpq's through normalize_sqlalchemy_url.
    engine = create_engine(url if form == "sqlalchemy" else normalize_sqlalchemy_url(url))
    key = f"order-{form}-{secrets.token_hex(4)}"
    try:
        with Session(engine) as session, outbox(session):
            assert session.execute(text("SELECT inet_server_port()")).scalar() == servers["port"]
            session.execute(text("INSERT INTO received (key, n, pids) VALUES (:k, 0, '{}')"), {"k": key})
            confirm.send(key)
            session.commit()
    finally:
        engine.dispose()
    start_worker(broker)
    confirmed = "SELECT count(*) FROM received WHERE key = %s AND n = 1"
    wait_for(lambda: count(db, confirmed, (key,)) == 1, 30, "the message run")


def test_an_async_outbox_session_through_a_multi_host_url(
    servers: dict[str, Any], make_broker: Any, db: Any
) -> None:
    url = url_of(servers, "libpq")
    broker = make_broker(url=url)
    queue = "multi_outbox_async"

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=queue)
    def confirm(key: str) -> None:
        pass

    async def write() -> int:
        engine = create_async_engine(normalize_sqlalchemy_url(url))
        try:
            async with AsyncSession(engine) as session:
                async with outbox(session):
                    port = (await session.execute(text("SELECT inet_server_port()"))).scalar()
                    confirm.send("async")
                    await session.commit()
            return int(port or 0)
        finally:
            await engine.dispose()

    assert asyncio.run(write()) == servers["port"]
    assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE queue_name = %s", (queue,)) == 1


def test_a_dramatiq_cli_worker_runs_on_a_multi_host_url(
    servers: dict[str, Any], make_broker: Any, db: Any
) -> None:
    url = url_of(servers, "libpq")
    # tests/worker_app.py builds its broker, and its actors their connection, from this URL
    worker = WorkerProcess(url, threads=2).start()
    try:
        key = f"cli-worker-{secrets.token_hex(4)}"
        make_broker(url=url).enqueue(
            dramatiq.Message(queue_name="default", actor_name="record", args=(key,), kwargs={}, options={})
        )
        wait_for(
            lambda: count(db, "SELECT count(*) FROM received WHERE key = %s", (key,)) == 1, 60, "the run"
        )
    finally:
        assert worker.stop() == 0


@pytest.mark.parametrize("form", FORMS)
def test_the_operator_cli_metrics_and_dashboard_read_through_a_multi_host_url(
    form: str, servers: dict[str, Any], db: Any
) -> None:
    url = url_of(servers, form)
    result = cli_status(url)
    assert result.returncode == 0, result
    assert "workers" in result.stdout.lower()

    collector = DatabaseCollector(url, cache_seconds=0)
    try:
        assert collector.read().up, collector.last_error
    finally:
        collector.close()

    async def dashboard_queues() -> list[Any]:
        store = Store(url, "dramatiq", "unused", timeout=10)
        await store.open()
        try:
            return await store.queues()
        finally:
            await store.close()

    assert isinstance(asyncio.run(dashboard_queues()), list)


def test_the_cli_says_when_no_server_is_what_target_session_attrs_asks_for(servers: dict[str, Any]) -> None:
    # Given a URL whose only live server of the list accepts writes, asking for a read-only one
    url = url_of(servers, "libpq").replace("target_session_attrs=read-write", "target_session_attrs=standby")
    url = url.replace(f"127.0.0.1:{servers['read_only_port']},", "")
    result = cli_status(url)
    # Then one line says so (not "connection refused", the first host's failure)
    assert result.returncode == 1, result
    (line,) = result.stderr.splitlines()
    assert "none of its servers is what target_session_attrs=standby asks for" in line, line
    assert "server is not in hot standby mode" in line and "connection refused" not in line, line


def test_migrations_and_the_scheduler_command_through_a_multi_host_url(
    servers: dict[str, Any], db: Any
) -> None:
    # Given a fresh schema migrated through libpq's form
    schema = f"multi_{secrets.token_hex(5)}"
    upgrade(url_of(servers, "libpq"), schema=schema)
    # When the scheduler command runs an app whose broker has libpq's form, with --url in SQLAlchemy's
    # (the same servers: the command accepts it as the broker's database)
    env = {**os.environ, "DPO_TEST_URL": url_of(servers, "libpq"), "DPO_SCHEMA": schema}
    scheduler = subprocess.Popen(
        [
            *(sys.executable, "-m", "dramatiq_pg_outbox.cli", "scheduler", "--app", "tests.periodic_app"),
            *("--url", url_of(servers, "sqlalchemy"), "--schema", schema),
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # Then its 1 s schedule enqueues on the test server
        ticks = f"SELECT count(*) FROM {schema}.messages"
        wait_for(lambda: scheduler.poll() is not None or count(db, ticks) >= 1, 60, "the first tick")
        assert scheduler.poll() is None, scheduler.communicate()[1]
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(30) == 0
    finally:
        if scheduler.poll() is None:
            os.killpg(scheduler.pid, signal.SIGKILL)
            scheduler.wait(30)
        db.execute(f'DROP SCHEMA "{schema}" CASCADE')
