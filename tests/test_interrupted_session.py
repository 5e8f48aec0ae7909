"""A test session that is interrupted still stops every process and drops every database it made.

An inner pytest session (tests/interrupted_session.py) starts workers, a supervisor and a
process no fixture knows about, then is stopped by Ctrl-C (SIGINT to pytest alone), by SIGTERM
(a cancelled CI job, `timeout`) or by pytest-timeout.  Every process it started carries a marker
in its environment, so the outer test can look for survivors in /proc, whatever process group or
parent they ended up with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.helpers import marked_processes, wait_for

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("interruption", ["ctrl-c", "sigterm", "timeout"])
def test_an_interrupted_session_leaves_no_process_and_no_database(
    interruption: str, admin_url: str, tmp_path: Path
) -> None:
    mark = uuid.uuid4().hex
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "DPO_OUTER_MARK": mark,
        "DPO_INNER_READY": str(ready),
        "DPO_INNER_MODE": interruption,
        "DRAMATIQ_PG_OUTBOX_TEST_URL": admin_url,
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interrupted_session.py"]
    # (SIGINT as a terminal's Ctrl-C delivers it: a shell's background job, as CI's may be, starts
    # with SIGINT ignored, and so would the inner session)
    inner = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # Given an inner session whose test has started its processes
        wait_for(
            lambda: ready.exists() or inner.poll() is not None, 120, "the inner test to start its processes"
        )
        assert ready.exists(), inner.communicate()[0].decode(errors="replace")
        database = ready.read_text()
        assert len(marked_processes("DPO_OUTER_MARK", mark)) >= 5  # pytest, 2 CLIs + their workers, sleep
        # When it is interrupted
        if interruption == "ctrl-c":
            inner.send_signal(signal.SIGINT)
        elif interruption == "sigterm":  # a cancelled CI job, `timeout`, `kill`
            inner.send_signal(signal.SIGTERM)
        output = inner.communicate(timeout=120)[0].decode(errors="replace")
        # Then it reports the interruption (or the timeout) and leaves nothing behind
        if interruption in ("ctrl-c", "sigterm"):
            assert inner.returncode == pytest.ExitCode.INTERRUPTED, output
            assert "KeyboardInterrupt" in output
        else:
            assert inner.returncode == pytest.ExitCode.TESTS_FAILED, output
            assert "Timeout" in output
        wait_for(
            lambda: not marked_processes("DPO_OUTER_MARK", mark), 10, "the inner session's processes to end"
        )
        with psycopg.connect(admin_url, autocommit=True) as conn:
            left = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (database,)).fetchone()
        assert left == (0,), f"database {database} was left behind"
    finally:
        inner.kill()
        inner.wait()
