"""Shared helpers of the benchmark suite: servers, databases, statistics, tables.

Every benchmark loop is bounded (a message count and a wall-clock cap).
Nothing here is imported by the package or the test suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

#: Longest wait for one drain / latency measurement, in seconds.
DEFAULT_CAP_S = 180.0
#: RabbitMQ on this machine kind.
RABBITMQ_URL = os.environ.get("BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")
#: Redis on this machine kind (database 7 is the suite's own).
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/7")

#: System names, in table order.
OURS = "dramatiq-pg-outbox"
STUB = "StubBroker"
REDIS = "RedisBroker"
RABBITMQ = "RabbitmqBroker"
DRAMATIQ_PG = "dramatiq-pg"
DRAMATIQ_POSTGRES = "dramatiq-postgres"
PGQUEUER = "pgqueuer"
#: pgqueuer with dequeue batches of 100 instead of its default 10 (asyncpg driver in both).
PGQUEUER_B100 = "pgqueuer-batch100"
ALL_SYSTEMS = (OURS, STUB, REDIS, RABBITMQ, DRAMATIQ_PG, DRAMATIQ_POSTGRES, PGQUEUER, PGQUEUER_B100)
POSTGRES_SYSTEMS = (OURS, DRAMATIQ_PG, DRAMATIQ_POSTGRES, PGQUEUER, PGQUEUER_B100)


@dataclass
class Series:
    """Repeated measurements of one quantity (e.g. msgs/s) for one system and case."""

    values: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def spread(self) -> str:
        if not self.values:
            return ""
        return f"{min(self.values):,.0f}-{max(self.values):,.0f}"


@dataclass
class Context:
    """What every scenario gets: the admin URL of the Postgres server and run options."""

    admin_url: str
    runs: int
    quick: bool
    systems: tuple[str, ...]
    out_dir: str
    results: dict[str, Any] = field(default_factory=dict)
    #: ``--smoke``: each scenario once on its smallest input, to check that it runs.
    smoke: bool = False
    #: What failed so far (``where: error``), see :meth:`failed`.
    failures: list[str] = field(default_factory=list)

    def db_url(self, name: str) -> str:
        return make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def failed(self, where: str, error: BaseException | str) -> str:
        """Record and print a measurement that failed; returns the error as one line.

        The scenario goes on with its other measurements (its table says ``failed``); a
        ``--smoke`` run exits non-zero naming the scenario.
        """
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.failures.append(f"{where}: {text}")
        print(f"  {where}: FAILED {text}", flush=True)
        return text


def db_name(system: str, scenario: str) -> str:
    """One database per system (and scenario), so systems never share a table or its bloat."""
    return "bench_" + scenario + "_" + re.sub(r"[^a-z0-9]+", "_", system.lower())


def reachable(url: str, default_port: int) -> bool:
    """Whether something accepts TCP connections at the host and port of ``url`` (within 2 s)."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=2):
            return True
    except OSError:
        return False


def recreate_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(admin_url: str, name: str) -> None:
    with contextlib.suppress(Exception), psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def connection_count(admin_url: str, dbname: str) -> int:
    """Client backends connected to ``dbname`` right now (the caller's own connection excluded)."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'",
            (dbname,),
        ).fetchone()
        return int(row[0]) if row else 0


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile, ``p`` in 0..100."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def busy_jiffies() -> int:
    """Busy time of the whole machine so far, in clock ticks (all CPUs, idle and iowait excluded)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]


def cpu_ms_per_message(ticks: int, n: int) -> float:
    """Milliseconds of CPU per message from ``ticks`` clock ticks spent on ``n`` messages."""
    return ticks * 1000.0 / os.sysconf("SC_CLK_TCK") / max(n, 1)


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def fmt_ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "-"
    return f"{ours / theirs:.2f}x"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_notes(admin_url: str) -> dict[str, Any]:
    notes: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    with psycopg.connect(admin_url, autocommit=True) as conn:
        for name in ("server_version", "fsync", "synchronous_commit", "shared_buffers", "max_connections"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            notes[name] = row[0] if row else None
    with contextlib.suppress(Exception):
        import dramatiq

        notes["dramatiq"] = dramatiq.__version__
    with contextlib.suppress(Exception):
        notes["git"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    return notes


@contextlib.contextmanager
def postgres_for_benchmarks(url: str | None) -> Iterator[str]:
    """An admin URL: the given server, or a private durable server with pg_stat_statements."""
    if url:
        yield url
        return
    from dramatiq_pg_outbox.testing import ThrowawayPostgres

    settings = {
        "shared_preload_libraries": "pg_stat_statements",
        "max_connections": 200,
        "fsync": "on",
        "synchronous_commit": "on",
        "shared_buffers": "256MB",
        "max_wal_size": "2GB",
        "track_wal_io_timing": "on",
    }
    with ThrowawayPostgres(settings) as server:
        yield server.url


def save_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
