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

pytestmark = pytest.mark.slow


def python_path() -> str:
    """This checkout first, so that the subprocesses import the package under test."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def test_the_django_example_suite_passes_with_nothing_skipped(admin_url: str) -> None:
    for module in ("django", "django_dramatiq", "pytest_django"):
        pytest.importorskip(module, reason=f"{module} is missing: pip install -e '.[dev]'")
    # Given the example's own test command, on this run's server (it creates its own databases)
    env = {**os.environ, "DRAMATIQ_PG_OUTBOX_TEST_URL": admin_url, "PYTHONPATH": python_path()}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the example's conftest names its own settings
    for name in [name for name in env if name.startswith("PYTEST_XDIST_")]:
        del env[name]  # this run's own pytest-xdist worker is not the example's
    # When it runs
    command = [sys.executable, "-m", "pytest", "-q"]
    done = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=240)
    # Then every test passed, none skipped
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    summary = done.stdout.strip().splitlines()[-1]  # (plugins' warnings go to stderr)
    assert re.search(r"\b\d+ passed\b", summary), output
    assert not re.search(r"skipped|xfail|deselected|error", summary), output


def test_without_django_the_module_names_the_extra_to_install() -> None:
    # Given a Python where Django cannot be imported
    code = "import sys; sys.modules['django'] = None; import dramatiq_pg_outbox.django"
    env = {**os.environ, "PYTHONPATH": python_path()}
    # When the Django module is imported
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    # Then the import fails with the command that installs what it needs
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: dramatiq_pg_outbox.django needs Django"), done.stderr
    assert "pip install 'dramatiq-pg-outbox[django]'" in last
