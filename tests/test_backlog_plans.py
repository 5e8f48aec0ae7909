"""The statements a worker runs now and then read a few pages, whatever the backlog.

The rescuer (``rescue``) runs every few seconds in every worker process and the orphan
check (``release_orphans``) after a lost claim reply.  Both find nothing to do almost
always; what they read then must not grow with the rows pending.  A table that was
just filled has no statistics (autovacuum has not analyzed it yet), the case that the
backlog scenario of the benchmarks measures (``python -m benchmarks.run --scenarios
backlog``), so each statement runs both on a fresh table and on an analyzed one.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from dramatiq_pg_outbox._queries import queries_for_schema

#: Pending rows written, with a payload that puts about 20 of them on a page.
ROWS, PAYLOAD = 30_000, b"x" * 300


def fill(db: Any) -> int:
    """Write ROWS pending rows with COPY, no statistics on messages; the heap's pages."""
    with (
        db.cursor() as cur,
        cur.copy("COPY dramatiq.messages (queue_name, actor_name, message_id, payload) FROM STDIN") as copy,
    ):
        for i in range(ROWS):
            copy.write_row(("default", "noop", f"m{i}", PAYLOAD))
    # What a fresh table has: no column statistics (a test before this one may have analyzed it)
    db.execute(
        "DELETE FROM pg_statistic WHERE starelid IN "
        "(SELECT relid FROM pg_partition_tree('dramatiq.messages'))"
    )
    row = db.execute(
        "SELECT sum(pg_relation_size(relid)) / current_setting('block_size')::bigint "
        "FROM pg_partition_tree('dramatiq.messages') WHERE isleaf"
    ).fetchone()
    return int(row[0])


def buffers(db: Any, name: str, params: dict[str, Any]) -> int:
    """Shared buffers that statement ``name`` touched (hit or read), run and rolled back."""
    with db.transaction(force_rollback=True):
        plan = db.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queries_for_schema("dramatiq")[name], params
        ).fetchone()[0][0]
    return int(plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0))


@pytest.mark.parametrize("statistics", ["none", "analyzed"])
def test_the_rescuer_and_the_orphan_check_read_a_few_pages_of_a_large_backlog(
    db: Any, statistics: str
) -> None:
    # Given 30,000 pending rows, nothing claimed, with no statistics or freshly analyzed ones
    pages = fill(db)
    assert pages > 400, pages
    if statistics == "analyzed":
        db.execute("ANALYZE dramatiq.messages")
    # When the rescuer and a process's orphan check run and find nothing to do
    rescue = buffers(
        db,
        "rescue",
        {
            "worker_id": uuid.uuid4(), "heartbeat_timeout_ms": 10_000, "max_lease_ms": None,
            "max_deliveries": 20, "channel": "dramatiq",
        },
    )  # fmt: skip
    orphans = buffers(db, "release_orphans", {"owner": uuid.uuid4(), "grace_ms": 1_000, "known_ids": []})
    # Then each reads a few index pages, not the table (on the parent commit, with no statistics,
    # a hash join of the CTE with messages read the whole heap first: more than `pages` buffers)
    assert rescue < 100 and orphans < 100, (rescue, orphans, pages)
