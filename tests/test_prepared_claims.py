"""A pooled connection plans the plain claims when it opens, not in a message's wake-up.

Planning a claim over the partitions of ``messages`` takes milliseconds:
psycopg's default prepares a statement at its sixth run on a connection, and keys
it by its parameters' types, which follow the size of each integer.  The runtime's pool
prepares at the first run, sends the claims' integers as bigint, and runs the plain claims
once, claiming nothing, on each connection of a process that consumes (benchmarks/README.md,
section 28).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import dramatiq
import psycopg

from dramatiq_pg_outbox.store.messages import LOOK_AHEAD, QueueClaim

#: What only the claims' statements hold (``FOR UPDATE SKIP LOCKED`` of their candidates).
CLAIMS = "%FOR UPDATE SKIP LOCKED%"


def prepared_claims(conn: psycopg.Connection[Any]) -> list[tuple[str, int | None]]:
    """(name, generic plans run; None before PostgreSQL 14) of the claims ``conn`` has prepared."""
    generic = "generic_plans" if conn.info.server_version >= 140000 else "NULL::bigint"
    rows = conn.execute(
        f"SELECT name, {generic} FROM pg_prepared_statements WHERE statement LIKE %s ORDER BY name",
        (CLAIMS,),
    ).fetchall()
    return [(str(name), plans) for name, plans in rows]


def test_a_consuming_process_has_the_plain_claims_prepared_and_planned_on_its_connections(
    make_broker: Any, start_worker: Any
) -> None:
    # Given a worker process of one queue, before any message
    broker = make_broker()
    dramatiq.actor(lambda: None, broker=broker, queue_name=f"prepared_{uuid.uuid4().hex[:8]}")
    start_worker(broker)
    # When one of its pooled connections is taken
    with broker.runtime.connection() as conn:
        found = prepared_claims(conn)
    # Then claim and claim_queues are prepared there, each as a sweep and bounded
    assert len(found) >= 4, found
    # And each has its generic plan made already
    if conn.info.server_version >= 140000:
        assert all(plans is not None and plans >= 1 for _, plans in found), found


def test_a_process_that_only_sends_plans_no_claim(make_broker: Any) -> None:
    # Given a broker that sends and has no consumer
    broker = make_broker()
    actor = dramatiq.actor(lambda: None, broker=broker, queue_name=f"prepared_{uuid.uuid4().hex[:8]}")
    actor.send()
    # When one of its pooled connections is taken
    with broker.runtime.connection() as conn:
        # Then no claim was prepared there: a producer's connections never claim
        assert prepared_claims(conn) == []


def test_a_claims_integers_of_any_size_run_the_statement_prepared_ahead(
    make_broker: Any, start_worker: Any
) -> None:
    # Given a worker process's pooled connection, with the claims prepared ahead
    broker = make_broker()
    queue = f"prepared_{uuid.uuid4().hex[:8]}"
    dramatiq.actor(lambda: None, broker=broker, queue_name=queue)
    start_worker(broker)
    runtime = broker.runtime
    now = dt.datetime.now(dt.timezone.utc)
    with runtime.connection() as conn:
        before = [name for name, _ in prepared_claims(conn)]
        # When it claims (more often than psycopg's default threshold) from watermark ids and
        # with limits of every integer size
        for size in (7, 40_000, 3_000_000_000):
            for _ in range(6):
                runtime.store.claim(
                    conn, prioritized=False, queue_name=queue, limit=min(size, 10_000), lease=uuid.uuid4(),
                    owner=runtime.worker_id, consumers=1, rank=0, look_ahead=LOOK_AHEAD,
                    from_at=now, from_id=size,
                )  # fmt: skip
                runtime.store.claim_queues(
                    conn, [QueueClaim(queue, min(size, 10_000), now, size, 1, 0)],
                    lease=uuid.uuid4(), owner=runtime.worker_id, look_ahead=LOOK_AHEAD,
                )  # fmt: skip
        after = [name for name, _ in prepared_claims(conn)]
    # Then every one of those claims ran a statement prepared when the connection opened
    assert after == before
