"""The dashboard in a real browser: headless Chromium driven by Playwright, a real worker, real PostgreSQL.

The browser is Debian's ``chromium`` (``apt-get install chromium chromium-driver``),
found at ``$DPO_CHROMIUM``, else ``chromium`` on the PATH, else ``/usr/bin/chromium``;
Playwright never downloads one here.  Without Playwright or Chromium these tests
skip with the reason; tests/test_dashboard.py still covers the HTTP level.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest

from tests.dashboard_support import DashboardServer, serve_dashboard
from tests.helpers import count, wait_for

__all__ = ["serve_dashboard"]  # the fixture, imported for pytest

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright for Python is not installed: pip install playwright"
)

#: Flags for a root user in a closed network (no sandbox, no calls home).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str | None:
    """Where Chromium is: ``$DPO_CHROMIUM``, ``chromium`` on the PATH, or Debian's ``/usr/bin/chromium``."""
    for candidate in (os.environ.get("DPO_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture
def page() -> Iterator[Any]:
    """A fresh Chromium page (1280 x 800)."""
    executable = chromium_path()
    if executable is None:
        pytest.skip("Chromium not found: apt-get install -y chromium chromium-driver, or set DPO_CHROMIUM")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 800})
        finally:
            browser.close()


def screenshot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
    print(f"\nscreenshot: {path}")


def test_a_dead_letter_retried_from_the_browser_runs_on_a_real_worker(
    make_broker: Any,
    start_worker: Any,
    db: Any,
    serve_dashboard: Callable[..., DashboardServer],
    page: Any,
    tmp_path: Path,
) -> None:
    # Given a payment that failed while the gateway was down, and a worker still running
    broker = make_broker()
    gateway = {"up": False}

    @dramatiq.actor(broker=broker, queue_name="payments", max_retries=0)
    def charge_card(order_id: int, cents: int) -> None:
        if not gateway["up"]:
            raise ConnectionError(f"payment gateway unreachable while charging order {order_id}")

    charge_card.send(1042, 1999)
    start_worker(broker)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 1, 30,
             "the dead letter")  # fmt: skip
    server = serve_dashboard(token="browser-token")

    # When an operator logs in with the token
    page.goto(server.url + "/failed")
    page.fill("input[name=token]", "browser-token")
    page.click("button:has-text('Log in')")
    page.wait_for_selector("#failed")
    # sees the dead letter, opens it: the traceback and the arguments are there
    listed = page.inner_text("#failed")
    assert "ConnectionError: payment gateway unreachable while charging order 1042" in listed
    page.click("#failed tbody tr:first-child td a")
    assert "Traceback (most recent call last):" in page.inner_text("pre.traceback")
    assert "1042" in page.inner_text("pre.payload")
    screenshot(page, tmp_path / "dead_letter.png")
    # and, the gateway being back, clicks Retry
    gateway["up"] = True
    page.click("button#retry")

    # Then the dashboard confirms it and the real worker runs the message to completion
    assert "Re-enqueued 1 dead letter(s): 1 on payments." in page.inner_text(".flash")
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'completed'") == 1, 30,
             "the retried message to complete")  # fmt: skip
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 0
    assert db.execute("SELECT actor_name, attempts FROM dramatiq.history").fetchall() == [("charge_card", 1)]
    # And the queues page shows it among the completed deliveries of the last hour
    page.goto(server.url + "/")
    cells = page.locator('tr[data-queue="payments"] td.num').all_inner_texts()
    assert cells[4:7] == ["1", "0", "0"], cells  # completed (1 h), failed (1 h), dead letters
    screenshot(page, tmp_path / "queues.png")


def test_a_script_in_an_error_text_does_not_run_in_the_browser(
    make_broker: Any,
    start_worker: Any,
    db: Any,
    serve_dashboard: Callable[..., DashboardServer],
    page: Any,
    tmp_path: Path,
) -> None:
    # Given a dead letter whose error text carries a script and an image with a handler
    broker = make_broker()

    @dramatiq.actor(broker=broker, max_retries=0)
    def parse(text: str) -> None:
        raise ValueError(text)

    parse.send("<script>window.__pwned = 'script'</script><img src=x onerror=\"window.__pwned = 'img'\">")
    start_worker(broker)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history") == 1, 30, "the dead letter")
    server = serve_dashboard()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))

    # When the failed page and the dead letter are shown
    page.goto(server.url + "/failed")
    listed = page.inner_text("#failed")
    page.click("#failed tbody tr:first-child td a")
    detail = page.inner_text("pre.traceback")
    screenshot(page, tmp_path / "escaped.png")

    # Then the markup is text on the page, and nothing ran
    assert "<script>window.__pwned = 'script'</script>" in listed
    assert "<img src=x onerror=" in detail
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("pre.traceback script, pre.traceback img").count() == 0
    assert dialogs == []
