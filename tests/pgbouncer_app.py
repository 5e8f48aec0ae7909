"""An application whose broker reaches PostgreSQL only through PgBouncer (``tests/test_pgbouncer.py``).

Configured from the environment: ``DPO_PGBOUNCER_URL`` (the database through a
PgBouncer in transaction pooling mode), ``DPO_TEST_URL`` (the same database,
directly: only for the actors' records, the tests' side channel).  The broker has
the settings the PgBouncer guide (docs/guides/pgbouncer.md) gives: ``listen=False`` and
``prepare_threshold=None``; the results backend and the periodic scheduler of each
worker process run on its pool.
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq
import psycopg
from dramatiq.results import Results

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.periodic import Periodic, periodic
from dramatiq_pg_outbox.results import PostgresBackend

broker = PostgresBroker(
    url=os.environ["DPO_PGBOUNCER_URL"],
    listen=False,
    prepare_threshold=None,
    max_fetch_interval=100,
    heartbeat_interval=200,
    heartbeat_timeout=1_000,
    rescue_interval=300,
    rotate_interval=500,
)
backend = PostgresBackend(broker=broker)
broker.add_middleware(Results(backend=backend))
broker.add_middleware(Periodic(poll_interval=200))
dramatiq.set_broker(broker)

_conn: dict[int, psycopg.Connection[Any]] = {}


def _record(key: str) -> int:
    """Count one run of ``key`` in the ``received`` table (directly); the runs so far."""
    pid = os.getpid()
    conn = _conn.get(pid)
    if conn is None or conn.closed:
        conn = _conn[pid] = psycopg.connect(os.environ["DPO_TEST_URL"], autocommit=True)
    row = conn.execute(
        "INSERT INTO received (key, n, pids) VALUES (%s, 1, ARRAY[%s]) "
        "ON CONFLICT (key) DO UPDATE SET n = received.n + 1, pids = received.pids || %s::int RETURNING n",
        (key, pid, pid),
    ).fetchone()
    assert row is not None
    return int(row[0])


@dramatiq.actor(max_retries=0, queue_name="pgbouncer")
def record(key: str) -> None:
    _record(key)


@dramatiq.actor(max_retries=1, min_backoff=100, max_backoff=100, queue_name="pgbouncer")
def fail_once(key: str) -> None:
    """Raises on its first run: its retry is written with the ack, through PgBouncer."""
    if _record(key) == 1:
        raise RuntimeError(f"first run of {key} fails on purpose")


@dramatiq.actor(store_results=True, queue_name="pgbouncer")
def add(x: int, y: int) -> int:
    return x + y


@periodic(every=300, name="pgbouncer_tick", tick_kwarg="tick")
@dramatiq.actor(max_retries=0, queue_name="pgbouncer")
def tick(tick: str) -> None:
    _record(f"tick:{tick}")
