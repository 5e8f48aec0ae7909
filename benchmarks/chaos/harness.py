"""Moving parts of the chaos suite: database, worker "hosts", a supervisor, producers, probes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from dramatiq import Message
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from dramatiq_pg_outbox import PostgresBroker, outbox
from dramatiq_pg_outbox.urls import normalize_sqlalchemy_url

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "default"

TABLES = """
CREATE TABLE IF NOT EXISTS chaos_received (
    key text PRIMARY KEY,
    n int NOT NULL,
    first_at timestamptz NOT NULL DEFAULT now(),
    last_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS chaos_started (key text NOT NULL, pid int NOT NULL, at timestamptz DEFAULT now());
CREATE TABLE IF NOT EXISTS chaos_orders (key text PRIMARY KEY, created_at timestamptz DEFAULT now());
CREATE TABLE IF NOT EXISTS chaos_attempts (key text PRIMARY KEY, n int NOT NULL);
CREATE TABLE IF NOT EXISTS chaos_ticks (at timestamptz NOT NULL);
CREATE TABLE IF NOT EXISTS chaos_spans (
    token uuid PRIMARY KEY,
    key text NOT NULL,
    ckey text,
    message_id text NOT NULL,
    attempt int,
    pid int NOT NULL,
    started timestamptz NOT NULL,
    ended timestamptz
);
"""


INSERT_ORDERS = text("INSERT INTO chaos_orders (key) SELECT unnest(CAST(:keys AS text[]))")


def work_message(key: str) -> Message[Any]:
    return Message(queue_name=QUEUE, actor_name="work", args=(key,), kwargs={}, options={})


def long_message(key: str, seconds: float) -> Message[Any]:
    return Message(queue_name=QUEUE, actor_name="long_task", args=(key, seconds), kwargs={}, options={})


def sqlalchemy_url(url: str) -> str:
    """``url`` for SQLAlchemy's psycopg dialect (a libpq host list included: failover scenarios)."""
    return normalize_sqlalchemy_url(url).render_as_string(hide_password=False)


class Db:
    """The orchestrator's own autocommit connection; reconnects after a database restart."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: psycopg.Connection[Any] | None = None

    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
        return self._conn

    def rows(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        deadline = time.monotonic() + 60
        while True:
            try:
                cur = self.conn().execute(query, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def value(self, query: str, params: Any = None) -> Any:
        return self.rows(query, params)[0][0]

    def backend_pid(self) -> int:
        return int(self.value("SELECT pg_backend_pid()"))

    def reset(self) -> None:
        self.rows(TABLES)
        self.rows(
            "TRUNCATE dramatiq.messages, dramatiq.history, dramatiq.workers, dramatiq.idempotency_keys, "
            "chaos_received, chaos_started, chaos_orders, chaos_attempts, chaos_spans, chaos_ticks"
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class Producer:
    """Sends ``work`` messages in the orchestrator process: each batch is one transaction that
    also inserts the business rows (``chaos_orders``), through :func:`outbox`."""

    def __init__(self, url: str) -> None:
        self.broker = PostgresBroker(url=url)
        dramatiq.set_broker(self.broker)
        self.engine: Engine = create_engine(sqlalchemy_url(url), pool_pre_ping=True)

    def send(self, keys: list[str], batch: int = 1_000) -> None:
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            with self.engine.connect() as conn:
                with outbox(conn, self.broker):
                    conn.execute(INSERT_ORDERS, {"keys": chunk})
                    for key in chunk:
                        self.broker.enqueue(work_message(key))
                conn.commit()

    def send_messages(self, pairs: list[tuple[str, Message[Any]]], batch: int = 1_000) -> None:
        """Send ``(business key, message)`` pairs, ``batch`` per transaction with their business rows."""
        for start in range(0, len(pairs), batch):
            chunk = pairs[start : start + batch]
            with self.engine.connect() as conn:
                with outbox(conn, self.broker):
                    conn.execute(INSERT_ORDERS, {"keys": [key for key, _ in chunk]})
                    self.broker.enqueue_many([message for _, message in chunk])
                conn.commit()

    def send_message(self, message: Message[Any], key: str) -> None:
        with self.engine.connect() as conn:
            with outbox(conn, self.broker):
                conn.execute(text("INSERT INTO chaos_orders (key) VALUES (:key)"), {"key": key})
                self.broker.enqueue(message)
            conn.commit()

    def close(self) -> None:
        self.broker.close()
        self.engine.dispose()


# -- worker hosts and their supervisor ----------------------------------------


class Host:
    """One ``dramatiq`` CLI (a "host") running benchmarks.chaos.app, in its own process group."""

    def __init__(
        self, name: str, url: str, logdir: Path, *, processes: int, threads: int, env: dict[str, str]
    ) -> None:
        self.name = name
        self.args = [
            sys.executable, "-m", "dramatiq", "benchmarks.chaos.app",
            "--processes", str(processes), "--threads", str(threads),
        ]  # fmt: skip
        self.env = {**os.environ, "CHAOS_URL": url, **env}
        self.log = logdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=log, stderr=log, start_new_session=True
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> list[int]:
        """PIDs of the CLI's worker processes."""
        if not self.alive():
            return []
        assert self.proc is not None
        try:  # Linux: the kernel lists a task's children
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split()]

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class Supervisor:
    """Restarts hosts whose CLI exited, like systemd's ``Restart=always`` (``RestartSec`` = delay).

    Dramatiq 2.2.1's CLI does not respawn a worker process that died: it
    stops its other workers and exits, so the supervisor restarts the whole CLI.
    """

    def __init__(self, hosts: Iterable[Host], restart_delay: float = 1.0) -> None:
        self.hosts = list(hosts)
        self.restart_delay = restart_delay
        self.restarts = 0
        self.exits: list[tuple[str, int | None, float]] = []
        self._stop = threading.Event()
        self._paused: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> Supervisor:
        for host in self.hosts:
            host.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for host in self.hosts:
                if host.proc is not None and host.proc.poll() is not None and host.name not in self._paused:
                    self.exits.append((host.name, host.proc.returncode, time.monotonic()))
                    if self._stop.wait(self.restart_delay):
                        return
                    host.start()
                    self.restarts += 1

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        """Stop supervising, then stop every host (SIGTERM, SIGKILL after ``timeout``)."""
        self._stop.set()
        self._thread.join()
        for host in self.hosts:
            host.signal(sig)
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            if host.proc is None:
                continue
            try:
                host.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                host.kill_all()


@contextlib.contextmanager
def cluster(
    url: str,
    logdir: Path,
    *,
    hosts: int = 2,
    processes: int = 2,
    threads: int = 4,
    env: dict[str, str] | None = None,
    restart_delay: float = 1.0,
) -> Iterator[Supervisor]:
    """Start supervised hosts; always stop (and if need be kill) them on exit."""
    members = [
        Host(f"host{chr(ord('A') + i)}", url, logdir, processes=processes, threads=threads, env=env or {})
        for i in range(hosts)
    ]
    supervisor = Supervisor(members, restart_delay).start()
    try:
        yield supervisor
    finally:
        supervisor.stop()
        for host in members:
            host.kill_all()


# -- measurements -------------------------------------------------------------


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.2) -> float:
    """Wait for ``condition``; return the seconds it took.  Raises TimeoutError."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - start


def gone(pid: int) -> bool:
    """Whether a process has died (a zombie that its parent has not reaped yet counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def worker_ids_of(db: Db, pids: Iterable[int]) -> list[Any]:
    return [r[0] for r in db.rows("SELECT id FROM dramatiq.workers WHERE pid = ANY(%s)", (list(pids),))]


def held_by(db: Db, worker_ids: list[Any]) -> list[int]:
    """Ids of the processing rows owned by these workers."""
    return [
        r[0]
        for r in db.rows(
            "SELECT id FROM dramatiq.messages WHERE state = 'processing' AND owner = ANY(%s)", (worker_ids,)
        )
    ]


def still_held(db: Db, ids: list[int], worker_ids: list[Any]) -> int:
    return int(
        db.value(
            "SELECT count(*) FROM dramatiq.messages WHERE id = ANY(%s) AND owner = ANY(%s)", (ids, worker_ids)
        )
    )


def keys_of_rows(db: Db, ids: list[int]) -> set[str]:
    """Business keys of stored messages (live or archived) by row id."""
    rows = db.rows(
        "SELECT payload FROM dramatiq.messages WHERE id = ANY(%s) "
        "UNION ALL SELECT payload FROM dramatiq.history WHERE id = ANY(%s)",
        (ids, ids),
    )
    return {str(Message.decode(bytes(p)).args[0]) for (p,) in rows}


@dataclass
class Counts:
    received: int
    duplicates: int
    dup_keys: set[str] = field(default_factory=set)


def counts(db: Db, prefix: str = "") -> Counts:
    received = int(db.value("SELECT count(*) FROM chaos_received WHERE key LIKE %s", (prefix + "%",)))
    dups = db.rows("SELECT key, n FROM chaos_received WHERE n > 1 AND key LIKE %s", (prefix + "%",))
    return Counts(received, sum(n - 1 for _, n in dups), {k for k, _ in dups})


def lost_keys(db: Db, sent: Iterable[str]) -> set[str]:
    got = {r[0] for r in db.rows("SELECT key FROM chaos_received")}
    return set(sent) - got


def random_keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:06d}" for i in range(n)]


def spawn_producer(url: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "benchmarks.chaos.producer", "--url", url, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=out,
            start_new_session=True,
        )


def producer_stats(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    out, _ = proc.communicate()
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def jitter(seconds: float) -> float:
    return seconds * random.uniform(0.8, 1.2)


# -- a TCP proxy the suite (and the tests) can cut ------------------------------


def _hang_up(*sockets: socket.socket) -> None:
    """Shut down and close each socket (one the peer already closed included)."""
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


class Proxy:
    """A TCP proxy that a test can cut: every connection closed, new ones refused (PostgreSQL, RabbitMQ)."""

    def __init__(self, upstream: tuple[str, int], latency: tuple[float, float] | None = None) -> None:
        """``latency``: (min, max) seconds each forwarded chunk waits (a slow link), or None."""
        self.upstream = upstream
        self.latency = latency
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen()
        self.port = self.server.getsockname()[1]
        self.blocked = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.blocked.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                # Forward each frame at once: with Nagle's algorithm against the peer's delayed
                # ACKs, every request-and-reply round trip would wait ~40 ms.
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.settimeout(None)
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.latency is not None:
                    time.sleep(random.uniform(*self.latency))
                if self.blocked.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        _hang_up(src, dst)

    def block(self) -> None:
        self.blocked.set()
        with self.lock:
            sockets, self.sockets = self.sockets, []
        _hang_up(*sockets)

    def unblock(self) -> None:
        self.blocked.clear()

    def close(self) -> None:
        self.closed.set()
        self.block()
        self.server.close()
