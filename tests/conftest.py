"""Fixtures: a real PostgreSQL, never a user's real database.

The server comes from ``$DRAMATIQ_PG_OUTBOX_TEST_URL`` (an admin URL), else a
Docker container via testcontainers when an engine is reachable, else the local
server on 127.0.0.1:5432, else a throwaway server started for the run
(``dramatiq_pg_outbox.testing.postgres_server``).  Each run creates its own
database ``dpo_test_<random>`` and drops it at the end.

``$DRAMATIQ_PG_OUTBOX_TEST_BINDIR`` (a PostgreSQL ``bin`` folder) runs the tests on another
PostgreSQL build: every server of the run is a throwaway server started from it (the session's
and the ones tests start themselves), never the local one.  ``.ci/run`` uses it to run the core
tests on the oldest and the newest supported majors.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.testing import ThrowawayPostgres, mask_password, postgres_server, scratch_database
from dramatiq_pg_outbox.testing.binaries import has_programs

from .helpers import SESSION_MARK, TEST_MARK, Supervisor, marked_processes, reap

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "dramatiq"

#: A PostgreSQL ``bin`` folder to run the tests on (see the module's docstring).
BINDIR_VAR = "DRAMATIQ_PG_OUTBOX_TEST_BINDIR"
URL_VAR = "DRAMATIQ_PG_OUTBOX_TEST_URL"


def pytest_configure(config: pytest.Config) -> None:
    """Mark every process this session starts (see ``reap_session_processes``), and make SIGTERM
    stop the session as Ctrl-C does."""
    os.environ[SESSION_MARK] = uuid.uuid4().hex
    atexit.register(reap_session_processes)
    bindir = os.environ.get(BINDIR_VAR)
    if bindir:
        if os.environ.get(URL_VAR):
            raise pytest.UsageError(f"${BINDIR_VAR} and ${URL_VAR} are both set: unset one of them")
        if not has_programs(Path(bindir)):
            raise pytest.UsageError(
                f"${BINDIR_VAR}={bindir} holds no initdb, pg_ctl and postgres: "
                "set it to a PostgreSQL bin folder"
            )
        # The servers tests start themselves (ThrowawayPostgres() without bindir=) come from the same build.
        os.environ["PG_BINDIR"] = bindir
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # Python's default SIGTERM ends the process at once: no fixture teardown, no atexit, so a
        # cancelled CI job or `timeout` would leave every worker and the test database behind.
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")


def pytest_unconfigure(config: pytest.Config) -> None:
    reap_session_processes()


def reap_session_processes() -> None:
    """Safety net at the end of a session, also an interrupted one: kill what it started and left.

    Runs after the session's fixtures were torn down (the throwaway server, if any, is stopped by
    then), from ``pytest_unconfigure`` and again at interpreter exit.
    """
    mark = os.environ.get(SESSION_MARK)
    if mark:
        reap(SESSION_MARK, mark)


@pytest.fixture(autouse=True)
def reap_test_processes() -> Iterator[None]:
    """Every process a test starts is gone when the test ends, even if the test failed.

    The test's own fixtures and ``finally`` blocks stop what it started; this fixture, torn down
    after them, kills whatever still carries the test's marker (a double fork, a worker process
    whose CLI was killed -9) and warns, so one test's workers can never consume the next test's
    messages.  Session fixtures (a throwaway server, Spark's JVM) are set up before it and do not
    carry the marker.
    """
    mark = uuid.uuid4().hex
    os.environ[TEST_MARK] = mark
    try:
        yield
    finally:
        del os.environ[TEST_MARK]
        commands = {pid: _command_line(pid) for pid in marked_processes(TEST_MARK, mark)}
        left = reap(TEST_MARK, mark)
        if left:
            shown = "; ".join(f"{pid} {commands.get(pid, '?')}" for pid in left)
            warnings.warn(f"killed {len(left)} process(es) the test left running: {shown}", stacklevel=1)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"dramatiq {dramatiq.__version__}, psycopg {psycopg.__version__}"]


@pytest.fixture(scope="session")
def admin_url() -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        bindir = os.environ.get(BINDIR_VAR)
        if bindir:
            url = stack.enter_context(ThrowawayPostgres(bindir=bindir)).url
        else:
            url = stack.enter_context(postgres_server(URL_VAR))
        with psycopg.connect(url, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            print(f"\nPostgreSQL {version[0] if version else '?'} at {mask_password(url)}")
        yield url


@pytest.fixture(scope="session")
def database_url(admin_url: str) -> Iterator[str]:
    """URL of a fresh database for this test run (``dpo_test_<random>``), migrated to head."""
    with scratch_database(admin_url, "dpo_test") as url:
        upgrade(url, schema=SCHEMA)
        yield url


@pytest.fixture(scope="session")
def standby_pair() -> Iterator[tuple[Any, Any]]:
    """(primary, hot standby): two throwaway servers of this run, streaming replication between
    them, the broker's schema migrated on the primary and replayed on the standby.

    Tests that pause the standby's replay use the ``standby`` fixture, which resumes it.
    """
    from dramatiq_pg_outbox.testing import ThrowawayPostgres

    try:
        primary = ThrowawayPostgres()
    except RuntimeError as e:
        pytest.skip(f"no PostgreSQL binaries for a throwaway primary and standby: {e}")
    with primary:
        upgrade(primary.url, schema=SCHEMA)
        with primary.start_standby() as standby:
            standby.wait_replayed()
            yield primary, standby


@pytest.fixture
def standby(standby_pair: tuple[Any, Any]) -> Iterator[Any]:
    """The standby of ``standby_pair``, caught up with its primary; its replay resumed afterwards.

    A transaction is committed on the primary first, so the standby has replayed a commit
    (``pg_last_xact_replay_timestamp()`` is NULL on a standby that replayed none since it started).
    """
    primary, server = standby_pair
    server.resume_replay()
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS replayed (at timestamptz NOT NULL DEFAULT now())")
        conn.execute("INSERT INTO replayed DEFAULT VALUES")
    server.wait_replayed()
    try:
        yield server
    finally:
        server.resume_replay()


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test database, with the broker's tables emptied."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE dramatiq.messages, dramatiq.history, dramatiq.workers, dramatiq.dead_letter_counts,"
            " dramatiq.finished_counts,"
            " dramatiq.idempotency_keys;"
            "CREATE TABLE IF NOT EXISTS received (key text PRIMARY KEY, n int NOT NULL, pids int[] NOT NULL);"
            "CREATE TABLE IF NOT EXISTS started (key text, pid int, at timestamptz DEFAULT now());"
            "TRUNCATE received, started;"
        )
        yield conn


#: Broker settings that make liveness checks fast enough for tests.
FAST = {
    "heartbeat_interval": 200,
    "heartbeat_timeout": 1_000,
    "rescue_interval": 300,
    "max_fetch_interval": 200,
}


@pytest.fixture
def make_broker(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Any]:
    """Factory of PostgresBrokers on the test database; closes them and resets the global broker."""
    brokers: list[PostgresBroker] = []
    workers: list[dramatiq.Worker] = []

    def factory(url: str | None = None, **options: Any) -> PostgresBroker:
        settings = {**FAST, **options}
        broker = PostgresBroker(url=url or database_url, **settings)
        brokers.append(broker)
        dramatiq.set_broker(broker)
        return broker

    factory.workers = workers  # type: ignore[attr-defined]
    yield factory
    for worker in workers:
        worker.stop(timeout=5_000)
    for broker in brokers:
        broker.close()


@pytest.fixture
def broker(make_broker: Any) -> PostgresBroker:
    return make_broker()  # type: ignore[no-any-return]


@pytest.fixture
def start_worker(make_broker: Any) -> Any:
    def start(broker: PostgresBroker, **options: Any) -> dramatiq.Worker:
        options.setdefault("worker_timeout", 100)
        options.setdefault("worker_threads", 4)
        worker = dramatiq.Worker(broker, **options)
        worker.start()
        make_broker.workers.append(worker)
        return worker

    return start


class WorkerProcess:
    """A ``dramatiq`` CLI worker running tests/worker_app.py in its own process group."""

    def __init__(self, url: str, *, processes: int = 1, threads: int = 4, env: dict[str, str] | None = None):
        self.args = [
            sys.executable, "-m", "dramatiq", "tests.worker_app",
            "--processes", str(processes), "--threads", str(threads),
        ]  # fmt: skip
        self.env = {**os.environ, "DPO_TEST_URL": url, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, start_new_session=True)
        return self

    def stop(self, sig: int = 15, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            if sig == 9:
                os.killpg(self.proc.pid, sig)
            else:
                # Only the main process: it forwards the signal to its workers.
                self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture
def worker_process(database_url: str) -> Iterator[Any]:
    """Factory of ``dramatiq`` CLI workers on the test database; ``Supervisor(worker_process, ...)``
    keeps one running.  At teardown every supervisor is paused first (none restarts a worker
    after its test), then every worker still running is killed with its process group."""
    started: list[WorkerProcess] = []
    supervisors: list[Supervisor] = []

    def start(**kwargs: Any) -> WorkerProcess:
        wp = WorkerProcess(database_url, **kwargs).start()
        started.append(wp)
        return wp

    start.supervisors = supervisors  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for supervisor in supervisors:
            supervisor.pause()
        for wp in started:
            if wp.proc is not None and wp.proc.poll() is None:
                wp.stop(9)


@pytest.fixture
def producer(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """tests/worker_app.py imported in the test process, used only to send."""
    monkeypatch.setenv("DPO_TEST_URL", database_url)
    from tests import worker_app

    dramatiq.set_broker(worker_app.broker)
    yield worker_app
    worker_app.broker.close()
