"""A pooled connection plans the plain claims when it opens, not in a message's wake-up.

Planning a claim over the partitions of ``messages`` takes milliseconds (3-9 ms on a 2-CPU
machine): psycopg's default prepares a statement at its sixth run on a connection, and keys
it by its parameters' types, which follow the size of each integer.  The runtime's pool
prepares at the first run, sends the claims' integers as bigint, and runs the plain claims
once, claiming nothing, when it opens a connection (benchmarks/README.md, section 28).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

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


def test_a_new_pooled_connection_has_the_plain_claims_prepared_and_planned(make_broker: Any) -> None:
    # Given a broker that has claimed nothing yet
    broker = make_broker()
    # When one of its pooled connections is taken
    with broker.runtime.connection() as conn:
        found = prepared_claims(conn)
    # Then claim and claim_queues are prepared there, each as a sweep and bounded
    assert len(found) == 4, found
    # And each has its generic plan made already
    if conn.info.server_version >= 140000:
        assert all(plans is not None and plans >= 1 for _, plans in found), found


def test_a_claims_integers_of_any_size_run_the_statement_prepared_ahead(make_broker: Any) -> None:
    # Given a broker's pooled connection, with the claims prepared as it opened
    broker = make_broker()
    runtime = broker.runtime
    queue = f"prepared_{uuid.uuid4().hex[:8]}"
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
