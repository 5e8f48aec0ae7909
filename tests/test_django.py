"""The Django example's tests (examples/django_app), in a pytest process of their own.

Django's settings are process-wide: configured here they would leak into every other test, so
the example's suite (pytest-django, its own conftest and pytest.ini) runs as the README tells a
newcomer to run it, on this run's server, and its exit status is the verdict.  What it covers:
examples/django_app/README.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "examples" / "django_app"


def test_the_django_example_suite_passes_with_nothing_skipped(admin_url: str) -> None:
    for module in ("django", "django_dramatiq", "pytest_django"):
        pytest.importorskip(module, reason=f"{module} is missing: pip install -e '.[dev]'")
    # Given the example's own test command, on this run's server (it creates its own databases)
    env = {
        **os.environ,
        "DRAMATIQ_PG_OUTBOX_TEST_URL": admin_url,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    # When it runs
    command = [sys.executable, "-m", "pytest", "-q"]
    done = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=240)
    # Then every test passed, none skipped
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary), output
    assert not re.search(r"skipped|xfail|deselected|error", summary), output
