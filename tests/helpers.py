"""Helpers shared by the process and chaos tests: waiting, counting, processes, a TCP proxy."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import pq

# The TCP proxy lives with the chaos suite, which cuts connections with it too.
from benchmarks.chaos.harness import Proxy as Proxy

#: The default isolation levels a database, a role or a URL may set (issue 31).
ISOLATION_LEVELS = ("read committed", "repeatable read", "serializable")


def with_options(url: str, options: str) -> str:
    """``url`` whose sessions start with the server settings ``options`` (``"-c name=value"``)."""
    return f"{url}{'&' if '?' in url else '?'}options={quote(options, safe='')}"


def with_url_default(url: str, level: str) -> str:
    """``url`` whose sessions default to ``level`` by its ``options`` parameter."""
    return with_options(url, "-c default_transaction_isolation=" + level.replace(" ", "\\ "))


def reachable(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (within 2 s)."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll ``condition`` every ``interval`` seconds (50 ms); return the seconds it took.

    Raises:
      AssertionError: ``condition`` was still false after ``timeout`` seconds (the message names ``what``).
    """
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


#: LISTEN connections on the test's own database (other test runs may share the server).
LISTENERS = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%%'"
)


def count(db: Any, query: str, params: Any = None) -> int:
    """The single integer a query returns."""
    return int(db.execute(query, params).fetchone()[0])


#: Environment variable every process a test starts inherits: its value names the test
#: (see the ``reap_test_processes`` fixture in conftest.py) or, for the session-wide safety net,
#: the pytest session (``SESSION_MARK``).
TEST_MARK = "DPO_TEST_MARK"
SESSION_MARK = "DPO_TEST_SESSION_MARK"


def drop_past_history_partitions(db: Any, schema: str = "dramatiq") -> int:
    """Drop the day partitions of ``history`` before today (UTC) that earlier tests created.

    The per-run test database is shared by the tests of one xdist worker; a test that counts what
    ``prune`` drops must not count the partitions another test left behind.  Returns the number
    dropped.
    """
    from dramatiq_pg_outbox.partitions import day_partitions

    today = dt.datetime.now(dt.timezone.utc).date()
    old = [p for p in day_partitions(db, schema) if p.day < today]
    for partition in old:
        db.execute(f'DROP TABLE "{schema}"."{partition.name}"')
    return len(old)


def marked_processes(name: str, value: str) -> list[int]:
    """PIDs of the live processes whose environment has ``name=value`` (Linux /proc), this one excluded.

    A process's environment is the one it was started with, so every descendant of a process
    started with the marker carries it too, even after its parent died (double forks, the
    ``dramatiq`` CLI's worker processes, a ``start_new_session`` group).
    """
    needle = f"{name}={value}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if (b"\0" + environ).find(b"\0" + needle) >= 0:
            found.append(int(entry.name))
    return found


def reap(name: str, value: str) -> list[int]:
    """SIGKILL every process carrying the marker, with its process group when it leads its own.

    Returns the PIDs found alive.  Never signals this process's own group.
    """
    pids = marked_processes(name, value)
    own_group = os.getpgrp()
    for pid in pids:
        try:
            group = os.getpgid(pid)
            if group != own_group and group == pid:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def children(pid: int) -> list[int]:
    """PIDs of a process's children (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class Supervisor:
    """Keeps one worker CLI running: starts a new one whenever the current one has exited.

    As systemd or Kubernetes would: Dramatiq's CLI does not respawn a dead worker process, it
    stops its other workers and exits.  ``start`` is the ``worker_process`` fixture's factory
    (with its keyword arguments); the fixture pauses every supervisor before it stops the
    processes, so a supervisor never outlives its test.
    """

    def __init__(self, start: Any, **options: Any) -> None:
        self.start_worker: Callable[[], Any] = lambda: start(**options)
        start.supervisors.append(self)
        self.current = self.start_worker()
        self.restarts = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                if not self._stop.is_set() and self.current.proc.poll() is not None:
                    self.current = self.start_worker()
                    self.restarts += 1

    def workers(self, db: Any, timeout: float = 30) -> dict[int, Any]:
        """{pid: worker id} of the current CLI's worker processes, once all have registered."""

        def registered() -> dict[int, Any]:
            pids = children(self.current.proc.pid)
            rows = db.execute("SELECT pid, id FROM dramatiq.workers WHERE pid = ANY(%s)", (pids,)).fetchall()
            return dict(rows) if pids and len(rows) == len(pids) else {}

        wait_for(lambda: bool(registered()), timeout, "worker processes to register")
        return registered()

    def pause(self) -> None:
        """Stop restarting (the current CLI keeps running)."""
        with self._lock:
            self._stop.set()
        self._thread.join()

    def stop(self) -> int:
        self.pause()
        return int(self.current.stop())


@contextmanager
def round_trips(dbapi_connection: psycopg.Connection[Any]) -> Iterator[Callable[[], int]]:
    """Count the round trips of a psycopg connection from a libpq trace: each run of messages
    sent that is followed by messages received is one wait for the server."""
    with tempfile.TemporaryFile("w+") as trace:
        dbapi_connection.pgconn.trace(trace.fileno())
        dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)

        def count() -> int:
            trace.seek(0)
            sides = [line.split("\t", 1)[0] for line in trace.read().splitlines() if line.strip()]
            return sum(1 for i, side in enumerate(sides) if side == "F" and (i == 0 or sides[i - 1] == "B"))

        try:
            yield count
        finally:
            dbapi_connection.pgconn.untrace()
