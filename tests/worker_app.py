"""Actors run by real ``dramatiq`` worker processes in the tests.

Configured from the environment: ``DPO_TEST_URL`` (database), ``DPO_*`` broker
settings.  Actors record what they did in the tables ``received`` (key, count,
pids) and ``started`` so the tests can compare what was sent with what ran.
"""

from __future__ import annotations

import os
import time
from typing import Any

import dramatiq
import psycopg

from dramatiq_pg_outbox import PostgresBroker


def _int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


broker = PostgresBroker(
    url=os.environ["DPO_TEST_URL"],
    heartbeat_interval=_int("DPO_HEARTBEAT_INTERVAL", 200),
    heartbeat_timeout=_int("DPO_HEARTBEAT_TIMEOUT", 1_000),
    rescue_interval=_int("DPO_RESCUE_INTERVAL", 300),
    max_fetch_interval=_int("DPO_MAX_FETCH_INTERVAL", 200),
    max_deliveries=_int("DPO_MAX_DELIVERIES", 3),
)
if os.environ.get("DPO_METRICS"):
    # Dramatiq's own Prometheus middleware (its exposition server serves both) and ours.
    from dramatiq.middleware.prometheus import Prometheus

    from dramatiq_pg_outbox.metrics import WorkerMetrics

    broker.add_middleware(Prometheus())
    broker.add_middleware(WorkerMetrics())
if os.environ.get("DPO_OTEL_SPANS"):
    # OpenTelemetry's SDK exporting each finished span at once to DPO_OTEL_SPANS/<pid>.jsonl,
    # and our tracing middleware (tests/test_tracing.py).
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from dramatiq_pg_outbox.tracing import TracingMiddleware
    from tests.otel_spans import JsonLinesExporter

    _provider = TracerProvider()
    _provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ["DPO_OTEL_SPANS"])))
    trace.set_tracer_provider(_provider)
    broker.add_middleware(TracingMiddleware())
dramatiq.set_broker(broker)

_conn: dict[int, psycopg.Connection[Any]] = {}


def _db() -> psycopg.Connection[Any]:
    pid = os.getpid()
    conn = _conn.get(pid)
    if conn is None or conn.closed or conn.broken:
        conn = _conn[pid] = psycopg.connect(os.environ["DPO_TEST_URL"], autocommit=True)
    return conn


def _execute(query: str, params: tuple[Any, ...]) -> None:
    # The tests also terminate this connection (pg_terminate_backend): reconnect once.
    try:
        _db().execute(query, params)
    except psycopg.OperationalError:
        _conn.pop(os.getpid(), None)
        _db().execute(query, params)


def _record(key: str) -> None:
    _execute(
        "INSERT INTO received (key, n, pids) VALUES (%s, 1, ARRAY[%s]) "
        "ON CONFLICT (key) DO UPDATE SET n = received.n + 1, pids = received.pids || %s::int",
        (key, os.getpid(), os.getpid()),
    )


@dramatiq.actor(max_retries=0)
def record(key: str) -> None:
    _record(key)


@dramatiq.actor(max_retries=0, time_limit=120_000)
def slow_record(key: str, seconds: float) -> None:
    _execute("INSERT INTO started (key, pid) VALUES (%s, %s)", (key, os.getpid()))
    time.sleep(seconds)
    _record(key)


@dramatiq.actor(max_retries=3, min_backoff=10, max_backoff=10, time_limit=120_000)
def spin(key: str, seconds: float) -> None:
    """Loops in Python for ``seconds`` (so an interruption lands at once), recording its start,
    then records the key.  Retries left: a retry would show a cancel that Retries saw."""
    _execute("INSERT INTO started (key, pid) VALUES (%s, %s)", (key, os.getpid()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(1_000))
    _record(key)


@dramatiq.actor(max_retries=0)
def note(*args: Any) -> None:
    """A callback (``on_success``/``on_failure``): records that it ran."""
    _record("callback")


@dramatiq.actor(max_retries=0)
def fail(key: str) -> None:
    """Raises: with max_retries=0, a dead letter."""
    raise RuntimeError(f"failed on purpose: {key}")


@dramatiq.actor(max_retries=0)
def traced_record(key: str) -> None:
    """Records the key inside a span of its own (a child of the current span, if any)."""
    from opentelemetry import trace

    with trace.get_tracer(__name__).start_as_current_span("actor body"):
        _record(key)


@dramatiq.actor(max_retries=1, min_backoff=10, max_backoff=10)
def fail_once(key: str) -> None:
    """Raises on its first run (recording the start), so Retries sends a retry; records the key next."""
    if _db().execute("SELECT 1 FROM started WHERE key = %s", (key,)).fetchone() is None:
        _execute("INSERT INTO started (key, pid) VALUES (%s, %s)", (key, os.getpid()))
        raise RuntimeError(f"failing once on purpose: {key}")
    _record(key)


@dramatiq.actor(max_retries=0)
def crash_once(key: str) -> None:
    """Kills its worker process on its first delivery (recording the start), records the key on the next."""
    if _db().execute("SELECT 1 FROM started WHERE key = %s", (key,)).fetchone() is None:
        _execute("INSERT INTO started (key, pid) VALUES (%s, %s)", (key, os.getpid()))
        os._exit(1)
    _record(key)


@dramatiq.actor(max_retries=0)
def crash(key: str) -> None:
    """Kills its own worker process (a poison message), recording the start first."""
    _execute("INSERT INTO started (key, pid) VALUES (%s, %s)", (key, os.getpid()))
    os._exit(1)


_limiter: dict[int, Any] = {}


def _contention_limiter() -> Any:
    """A ConcurrentRateLimiter(limit=3) on the rate-limit tables, one per process."""
    limiter = _limiter.get(os.getpid())
    if limiter is None:
        from dramatiq.rate_limits import ConcurrentRateLimiter

        from dramatiq_pg_outbox.rate_limits import PostgresBackend

        backend = PostgresBackend(broker=broker)
        limiter = _limiter[os.getpid()] = ConcurrentRateLimiter(backend, "contention", limit=3, ttl=60_000)
    return limiter


@dramatiq.actor(max_retries=0, time_limit=120_000)
def limited(key: str, hold: float) -> None:
    """Runs its critical section under the limiter (retrying until admitted), counting holders."""
    while True:
        with _contention_limiter().acquire(raise_on_failure=False) as acquired:
            if acquired:
                # One row: the UPDATE's row lock makes running and peak exact.
                _execute("UPDATE limiter SET running = running + 1, peak = greatest(peak, running + 1)", ())
                time.sleep(hold)
                _execute("UPDATE limiter SET running = running - 1, runs = runs + 1", ())
                break
        time.sleep(0.002)
    _record(key)


@dramatiq.actor(max_retries=0, time_limit=120_000)
def span(group: str, seconds: float) -> None:
    """Records when it ran (table ``spans``, made by the test): the limit checks of concurrency keys."""
    row = (
        _db()
        .execute(
            "INSERT INTO spans (grp, pid, started) VALUES (%s, %s, clock_timestamp()) RETURNING id",
            (group, os.getpid()),
        )
        .fetchone()
    )
    assert row is not None
    time.sleep(seconds)
    _execute("UPDATE spans SET ended = clock_timestamp() WHERE id = %s", (row[0],))
