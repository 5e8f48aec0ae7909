"""The history checker's short run (benchmarks/chaos/checker.py): random operations and faults under
each default isolation level, on a throwaway server of its own (the run restarts PostgreSQL), and
every promise of docs/guarantees.md checked from the record: no anomaly.

About a minute; ``python -m benchmarks.chaos --scenarios 11 --duration 1800`` is the long run.
The seed is printed with each run's line: ``python -m benchmarks.chaos.checker --seed S
--isolation RR --duration 8`` runs the same schedule of operations and faults again.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks.chaos.checker import LEVELS, run_levels
from dramatiq_pg_outbox.testing import find_postgres_bindir

pytestmark = pytest.mark.slow


NO_SERVER_PROGRAMS = find_postgres_bindir() is None


@pytest.mark.skipif(NO_SERVER_PROGRAMS, reason="needs PostgreSQL's server programs (initdb, pg_ctl)")
def test_random_operations_under_faults_break_no_promise_under_each_isolation_default(
    tmp_path: Path,
) -> None:
    seed = random.randrange(2**31)
    reports = run_levels(seed, duration=7, levels=LEVELS, logdir=tmp_path, big_spark_task=300)
    lines = [r.line() for r in reports]
    for report in reports:
        # The run did what it is for: operations of every kind, and faults.
        assert report.messages > 100, report.line()
        assert {"plain", "keyed", "outbox", "spark", "pipeline", "window"} <= set(report.ops), report.line()
        assert sum(report.faults.values()) > 0, report.line()
        # The third client's after-commit wake-ups were written by its committing threads.
        assert report.written_at_commit > 0, report.line()
    details = [f"{kind}: {item}" for r in reports for kind, items in r.examples.items() for item in items]
    assert not any(r.anomalies for r in reports), "\n".join(lines + details)
