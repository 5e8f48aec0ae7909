"""Upgrading a large history (issue 19): how long migration 0007 takes per million rows.

``python -m benchmarks.run --scenarios migrate [--migrate-rows N]`` (default 1,000,000):
a database at revision 0006 whose history holds N rows finished over the last 120
days (a 200-byte payload each, a third of them failed with an error text), then,
timed: the upgrade to 0007 (history copied into day partitions; what ``migrate``
announces and shows progress of) and the downgrade back to 0006.  The upgrade
notes of docs/guides/migrations.md quote the upgrade's seconds per million rows; 0007's own estimate
(``SECONDS_PER_MILLION``) comes from here.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from .bench_common import Context, Series, drop_database, markdown_table, recreate_database
from .bench_systems import getenv_int

DATABASE = "bench_migrate"


def fill(url: str, rows: int) -> float:
    """History rows at revision 0006 (one INSERT ... SELECT); returns seconds taken."""
    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, "
            "enqueued_at, started_at, finished_at, error_type, error, payload) "
            "SELECT i, 'q' || (i %% 5), 'actor_' || (i %% 7), md5(i::text), "
            "CASE WHEN i %% 3 = 0 THEN 'failed' ELSE 'completed' END, 1 + i %% 3, "
            "now() - (i * 120 * 86400.0 / %(rows)s) * interval '1 s' - interval '2 s', "
            "now() - (i * 120 * 86400.0 / %(rows)s) * interval '1 s' - interval '1 s', "
            "now() - (i * 120 * 86400.0 / %(rows)s) * interval '1 s', "
            "CASE WHEN i %% 3 = 0 THEN 'ValueError' END, "
            "CASE WHEN i %% 3 = 0 THEN 'Traceback (most recent call last): ... ValueError: row ' || i END, "
            "convert_to(repeat('x', 200), 'UTF8') "
            "FROM generate_series(1, %(rows)s) AS i",
            {"rows": rows},
        )
        conn.execute("VACUUM ANALYZE dramatiq.history")
    return time.perf_counter() - t0


def check(url: str, rows: int) -> None:
    """Every row is still there (a timing of a lossy migration would mean nothing)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(DISTINCT id) FROM dramatiq.history").fetchone()
    if row is None or row[0] != rows:
        raise RuntimeError(f"history holds {row[0] if row else None} rows after the migration, not {rows}")


def run(ctx: Context) -> dict[str, Any]:
    from dramatiq_pg_outbox import downgrade, upgrade

    rows = getenv_int("BENCH_MIGRATE_ROWS", 2_000 if ctx.smoke else 100_000 if ctx.quick else 1_000_000)
    url = ctx.db_url(DATABASE)
    series = {"upgrade to 0007": Series(), "downgrade to 0006": Series()}
    try:
        for run_no in range(ctx.runs):
            recreate_database(ctx.admin_url, DATABASE)
            upgrade(url, schema="dramatiq", revision="0006")
            fill_s = fill(url, rows)
            t0 = time.perf_counter()
            upgrade(url, schema="dramatiq", revision="0007")
            up = time.perf_counter() - t0
            check(url, rows)
            t0 = time.perf_counter()
            downgrade(url, schema="dramatiq", revision="0006")
            down = time.perf_counter() - t0
            check(url, rows)
            series["upgrade to 0007"].values.append(up / rows * 1e6)
            series["downgrade to 0006"].values.append(down / rows * 1e6)
            print(
                f"  migrate run {run_no + 1}: {rows:,} rows (filled in {fill_s:.1f} s): "
                f"upgrade {up:.1f} s, downgrade {down:.1f} s",
                flush=True,
            )
    finally:
        drop_database(ctx.admin_url, DATABASE)
    table = markdown_table(
        ["step", "seconds per million rows (median)", "min-max"],
        [
            [name, f"{s.median:.1f}" if s.median else "-", f"{min(s.values):.1f}-{max(s.values):.1f}"]
            for name, s in series.items()
            if s.values
        ],
    )
    return {"rows": rows, "runs": ctx.runs, "table": table}
