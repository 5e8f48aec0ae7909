"""What each Spark write did: one row per committed write of ``format("dramatiq")``.

Storage layout
--------------
``spark_writes``  id (identity) -> batch_id (the write's ``batch`` option), spark_batch
                  (the micro-batch id of a streaming write; -1 for a batch write),
                  tasks (partitions written), rows (read), enqueued (new messages),
                  skipped (rows whose key was known: an earlier run, a retried task,
                  another partition), repeated (rows whose key an earlier row of their
                  partition had), seconds (from the write's planning to its commit),
                  committed_at.

Written by the data source's ``commit()`` on the driver side, once every task has
committed (PySpark's Python data source API gives ``save()`` no value to return:
the figures are read back with ``dramatiq_pg_outbox.spark.write_counts``).  A
re-run of a batch id is a row of its own (its ``enqueued`` is what it added).
Nothing deletes these rows: one per write; delete old ones by hand if ever needed.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.spark_writes (
            id           bigint           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            batch_id     text             NOT NULL,
            spark_batch  bigint           NOT NULL DEFAULT -1,
            tasks        integer          NOT NULL,
            rows         bigint           NOT NULL,
            enqueued     bigint           NOT NULL,
            skipped      bigint           NOT NULL,
            repeated     bigint           NOT NULL,
            seconds      double precision NOT NULL,
            committed_at timestamptz      NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(f"CREATE INDEX spark_writes_batch_idx ON {s}.spark_writes (batch_id, id)")
    set_schema_revision(op.execute, schema_for_migration(), 19)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.spark_writes")
    set_schema_revision(op.execute, schema_for_migration(), 18)
