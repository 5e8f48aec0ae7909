"""The examples run end to end, as the READMEs tell a newcomer to run them.

Each run is the real command in a subprocess: an SMTP server, ``dramatiq`` worker
processes, signups that commit or roll back, and (with ``--relay``) a
``dramatiq-pg-outbox relay`` process and RabbitMQ or Redis workers.  Its exit
status is its verdict: one email per committed signup, none for a rolled-back one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import reachable

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run_example(command: list[str], admin_url: str) -> tuple[str, dict[str, str]]:
    """Run ``python -m <command>`` on the test server: its output and its report's "name  value" lines."""
    done = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": admin_url},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, dict(re.findall(r"^  (\S.*?) {2,}(\S+)", done.stdout, re.MULTILINE))


@pytest.mark.parametrize("relay", [None, "rabbitmq", "redis"])
def test_the_transactional_email_example_delivers_one_email_per_committed_signup(
    relay: str | None, admin_url: str
) -> None:
    pytest.importorskip("aiosmtpd", reason="the example needs its extra: pip install -e '.[example]'")
    if relay is not None:
        pytest.importorskip("pika" if relay == "rabbitmq" else "redis")
        port = 5672 if relay == "rabbitmq" else 6379
        if not reachable("127.0.0.1", port):
            pytest.skip(f"no {relay} server on 127.0.0.1:{port}")
    # Given the example's command, on the test server, with a few hundred signups
    command = ["examples.transactional_email", "--signups", "300", "--processes", "1"]
    if relay is not None:
        command += ["--relay", relay]
    # When it runs
    output, lines = run_example(command, admin_url)
    # Then it reports every committed signup emailed once, and nothing for the rolled-back ones
    assert lines["signups committed"] == lines["emails received"] == "264"
    assert lines["duplicates"] == lines["missing"] == "0"
    assert "OK: every committed signup got exactly one email" in output
    if relay is not None:
        assert f"relayed to {relay}" in output


def test_the_periodic_jobs_example_runs_each_tick_once_although_a_scheduler_is_killed(
    admin_url: str,
) -> None:
    # Given the example's command: three schedulers of a one-second job, one of them killed -9
    command = ["examples.periodic_jobs", "--seconds", "8", "--schedulers", "3"]
    # When it runs
    output, lines = run_example(command, admin_url)
    # Then every tick from the first to the last was enqueued once and ran once
    assert int(lines["ticks enqueued"]) >= 4
    assert lines["ticks enqueued"] == lines["jobs run"]
    assert lines["ticks enqueued twice"] == lines["ticks missing"] == lines["jobs run twice"] == "0"
    assert "killed scheduler" in output
