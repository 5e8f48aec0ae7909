"""The example alerting rules (docs/prometheus-alerts.yml) under promtool's unit tests.

promtool comes from Debian's ``prometheus`` package without installing it (the package
brings a server and tries to start its service): ``apt-get download prometheus`` and
``dpkg -x``, cached under ``~/.cache/dramatiq-pg-outbox``; a ``promtool`` on the PATH is
used first.  Where neither works, the tests skip with the reason, as the browser tests do
without Chromium.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

DOCS = Path(__file__).resolve().parent.parent / "docs"
RULES = DOCS / "prometheus-alerts.yml"
RULE_TESTS = DOCS / "prometheus-alerts.test.yml"
CACHE = Path.home() / ".cache" / "dramatiq-pg-outbox" / "promtool"


def _promtool() -> str:
    """The path of a promtool binary, or a skip naming what failed."""
    found = shutil.which("promtool")
    if found:
        return found
    if CACHE.exists():
        return str(CACHE)
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        pytest.skip("promtool is not on the PATH and apt-get/dpkg are missing to fetch it")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(
                ["apt-get", "download", "-q", "prometheus"],
                cwd=tmp,
                check=True,
                capture_output=True,
                timeout=300,
            )
            (deb,) = Path(tmp).glob("prometheus_*.deb")
            subprocess.run(["dpkg", "-x", str(deb), f"{tmp}/x"], check=True, capture_output=True, timeout=120)
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            pytest.skip(f"promtool could not be had (apt-get download prometheus; dpkg -x): {e}")
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f"{tmp}/x/usr/bin/promtool", CACHE)
    return str(CACHE)


@pytest.fixture(scope="module")
def promtool() -> str:
    return _promtool()


def test_the_rules_are_valid(promtool: str) -> None:
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rule_passes_its_unit_tests(promtool: str) -> None:
    # (among them: a paused queue whose due messages wait pages nobody, and a queue without a
    # live worker pages even when other queues have workers)
    done = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=DOCS, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rule_has_a_case_in_which_it_fires() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {
        check["alertname"]
        for case in cases
        for check in case.get("alert_rule_test", [])
        if check["exp_alerts"]
    }
    assert alerts == fired
