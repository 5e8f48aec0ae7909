"""A refusal that retrying cannot fix fails at once, for a library user and for a ``dramatiq`` worker.

The shared server trusts local connections, so these tests start a server of their own
that asks role ``app`` for a password (scram-sha-256) and lets the superuser in.
Waiting stays the answer to what can pass (a refused connection, a server starting).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from dramatiq.errors import ConnectionFailed

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.errors import ConnectionRejected
from dramatiq_pg_outbox.testing import ThrowawayPostgres

from .helpers import Proxy

ROOT = Path(__file__).resolve().parent.parent
#: A pool_timeout far longer than any of these tests may take to see the error.
LONG_WAIT = 60_000


@pytest.fixture(scope="module")
def password_server() -> Iterator[ThrowawayPostgres]:
    try:
        server = ThrowawayPostgres({"password_encryption": "scram-sha-256"})
    except RuntimeError as e:
        pytest.skip(f"cannot start a PostgreSQL server with password authentication: {e}")
    with server:
        hba = server.data_dir / "pg_hba.conf"
        hba.write_text(
            "local all postgres trust\n"
            "host all postgres 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
        )
        with psycopg.connect(server.url_for("postgres"), autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("CREATE ROLE app LOGIN PASSWORD 'right-password'")
            conn.execute("CREATE DATABASE app OWNER app")
        upgrade(server.url_for("app"))
        with psycopg.connect(server.url_for("app"), autocommit=True) as conn:
            conn.execute(
                "GRANT ALL ON SCHEMA dramatiq TO app; GRANT ALL ON ALL TABLES IN SCHEMA dramatiq TO app"
            )
            conn.execute("GRANT ALL ON ALL SEQUENCES IN SCHEMA dramatiq TO app")
        yield server


def _url(server: ThrowawayPostgres, user: str, password: str, dbname: str) -> str:
    return f"postgresql://{user}:{password}@127.0.0.1:{server.port}/{dbname}"


@pytest.mark.parametrize(
    ("user", "password", "dbname", "expected"),
    [
        ("app", "wrong-password", "app", "refused user 'app': password authentication failed"),
        ("nobody_here", "wrong-password", "app", "refused user 'nobody_here'"),
        ("app", "right-password", "no_such_db", "has no database 'no_such_db'"),
    ],
)
def test_a_send_fails_at_once_with_the_cause_when_the_server_refuses_for_good(
    password_server: ThrowawayPostgres, user: str, password: str, dbname: str, expected: str
) -> None:
    # Given a broker whose URL the server refuses (pool_timeout a minute)
    broker = PostgresBroker(url=_url(password_server, user, password, dbname), pool_timeout=LONG_WAIT)
    try:
        started = time.monotonic()
        # When a message is sent
        with pytest.raises(ConnectionRejected) as raised:
            broker.queue_size("default")
        # Then the cause comes at once, in one line, without the password
        assert time.monotonic() - started < LONG_WAIT / 1000 / 4
        text = str(raised.value)
        assert expected in text and "\n" not in text and password not in text, text
        assert isinstance(raised.value, ConnectionFailed)
    finally:
        broker.close()


def test_a_refusal_after_a_slow_first_attempt_fails_at_once(password_server: ThrowawayPostgres) -> None:
    # Given a link on which the pool's first connection attempt takes longer than the 50 ms
    # between two looks for a refusal (each forwarded chunk waits 100 ms)
    proxy = Proxy(("127.0.0.1", password_server.port), latency=(0.1, 0.1))
    url = f"postgresql://app:wrong-password@127.0.0.1:{proxy.port}/app"
    broker = PostgresBroker(url=url, pool_timeout=LONG_WAIT)
    try:
        started = time.monotonic()
        # When a message is sent
        with pytest.raises(ConnectionRejected) as raised:
            broker.queue_size("default")
        # Then the refusal still comes at once, not after pool_timeout
        assert time.monotonic() - started < LONG_WAIT / 1000 / 4
        assert "password authentication failed" in str(raised.value)
    finally:
        broker.close()
        proxy.close()


def test_the_right_password_still_works_and_a_closed_port_is_still_waited_for(
    password_server: ThrowawayPostgres,
) -> None:
    broker = PostgresBroker(url=_url(password_server, "app", "right-password", "app"))
    try:
        assert broker.queue_size("default") == 0
    finally:
        broker.close()
    # A refused connection can pass (a server restarting): waited for, pool_timeout long.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    broker = PostgresBroker(url=f"postgresql://app:x@127.0.0.1:{port}/app", pool_timeout=1_500)
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionFailed) as raised:
            broker.queue_size("default")
        assert not isinstance(raised.value, ConnectionRejected)
        assert time.monotonic() - started >= 1.4
    finally:
        broker.close()


def test_a_worker_refused_for_good_stops_at_once_with_one_line(
    password_server: ThrowawayPostgres, tmp_path: Path
) -> None:
    # Given the dramatiq command on a URL with a wrong password
    url = _url(password_server, "app", "wrong-password", "app")
    env = {**os.environ, "DPO_TEST_URL": url}
    args = [sys.executable, "-m", "dramatiq", "tests.worker_app", "--processes", "1", "--threads", "2"]
    started = time.monotonic()
    # When it starts
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    # Then it stops by itself, with Dramatiq's "broker connection failed" code, and says why in one line
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert time.monotonic() - started < 45
    lines = [line for line in proc.stderr.splitlines() if "password authentication failed" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Check the user name and password in the URL" in lines[0]
    assert "wrong-password" not in proc.stderr and "Traceback" not in proc.stderr
