"""The dashboard in a real browser: headless Chromium driven by Playwright, a real worker, real PostgreSQL.

The browser is Debian's ``chromium`` (``apt-get install chromium chromium-driver``),
found at ``$DPO_CHROMIUM``, else ``chromium`` on the PATH, else ``/usr/bin/chromium``;
Playwright never downloads one here.  Without Playwright or Chromium these tests
skip with the reason; tests/test_dashboard.py still covers the HTTP level.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
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
def browser() -> Iterator[Any]:
    """Headless Chromium (closed when the test ends)."""
    executable = chromium_path()
    if executable is None:
        pytest.skip("Chromium not found: apt-get install -y chromium chromium-driver, or set DPO_CHROMIUM")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any) -> Any:
    """A fresh Chromium page (1280 x 800)."""
    return browser.new_page(viewport={"width": 1280, "height": 800})


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


def live_updates(page: Any) -> int:
    """How many times the live page's script has updated it in place (``data-live-updates``)."""
    return int(page.get_attribute("body", "data-live-updates") or 0)


def watch(page: Any) -> tuple[list[str], list[str], list[str]]:
    """What a page loads and reports, as it happens: (whole-page loads, live updates, problems).

    Problems: console errors (a Content-Security-Policy violation is one; the browser's own
    request of ``/favicon.ico`` aside), script errors and ``securitypolicyviolation`` events.
    """
    documents: list[str] = []
    updates: list[str] = []
    problems: list[str] = []

    def on_request(request: Any) -> None:
        if request.resource_type == "document":
            documents.append(request.url)
        elif request.headers.get("x-live") == "1":
            updates.append(request.url)

    page.on("request", on_request)

    def on_console(message: Any) -> None:
        # The browser asks for /favicon.ico of its own accord: the dashboard has none (404).
        if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico"):
            problems.append(f"{message.text} ({message.location.get('url')})")

    page.on("console", on_console)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.expose_function("reportViolation", lambda text: problems.append(f"CSP: {text}"))
    page.add_init_script(
        "document.addEventListener('securitypolicyviolation',"
        " e => window.reportViolation(e.violatedDirective + ' ' + e.blockedURI))"
    )
    return documents, updates, problems


def test_a_queue_page_pages_filters_tells_running_from_prefetched_and_runs_a_delayed_message_now(
    make_broker: Any,
    start_worker: Any,
    db: Any,
    serve_dashboard: Callable[..., DashboardServer],
    page: Any,
    tmp_path: Path,
) -> None:
    # Given a worker with one thread busy on a report, two more reports claimed behind it,
    # and 105 archive jobs delayed by an hour, on one queue
    broker = make_broker(heartbeat_interval=200)
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name="reports")
    def render(i: int) -> None:
        release.wait(60)

    @dramatiq.actor(broker=broker, queue_name="reports")
    def archive(i: int) -> None:
        pass

    for i in range(105):
        archive.send_with_options(args=(i,), delay=3_600_000)
    for i in range(3):
        render.send(i)
    start_worker(broker, worker_threads=1)
    try:
        wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages WHERE state = 'processing'") == 3,
                 30, "the three reports to be claimed")  # fmt: skip
        reported = "SELECT count(*) FROM dramatiq.workers WHERE cardinality(running) = 1"
        wait_for(lambda: count(db, reported) == 1, 30, "a heartbeat that reports the running one")
        server = serve_dashboard(refresh=1)

        # When the operator opens the queue: the processing rows come first
        page.goto(server.url + "/queues/reports")
        states = page.locator("#messages td.state").all_inner_texts()
        # Then one report is running and two are prefetched, the rest delayed; 100 per page
        assert states[:3].count("running") == 1 and states[:3].count("prefetched") == 2, states[:4]
        assert len(states) == 100 and set(states[3:]) == {"delayed"}
        assert "Messages 1 to 100" in page.inner_text("#showing")
        # And the page updates itself in place (a marker set in the page survives the updates)
        page.evaluate("window.__marker = 1")
        updates = live_updates(page)
        wait_for(lambda: live_updates(page) >= updates + 2, 10, "two updates of the page")
        assert page.evaluate("window.__marker") == 1
        screenshot(page, tmp_path / "queue.png")
        # And the next page holds the last 8 rows
        page.click("#next-page")
        assert page.locator("#messages tbody tr").count() == 8
        assert "Messages 101 to 108" in page.inner_text("#showing")
        # And the filters select what waits for what: delayed archive jobs only, then processing only
        page.goto(server.url + "/queues/reports?refresh=off")
        assert page.locator("meta[http-equiv=refresh]").count() == 0
        page.select_option("select[name=status]", "processing")
        page.click("#message-filters button")
        assert sorted(page.locator("#messages td.state").all_inner_texts()) == [
            "prefetched",
            "prefetched",
            "running",
        ]
        page.select_option("select[name=status]", "delayed")
        page.select_option("select[name=actor]", "archive")
        page.click("#message-filters button")
        assert set(page.locator("#messages tbody td:nth-child(2)").all_inner_texts()) == {"archive"}
        # When the operator opens the first delayed one (its page offers Run now too), goes back,
        # runs it now from the list, and the reports finish
        first = page.locator("#messages tbody tr").first
        row_id = int(first.get_attribute("data-id"))
        page.goto(f"{server.url}/messages/{row_id}")
        assert page.locator("button#run-now").count() == 1
        page.go_back()
        first = page.locator(f'#messages tbody tr[data-id="{row_id}"]')
        first.locator("button:has-text('Run now')").click()
        assert f"Message {row_id} is due now" in page.inner_text(".flash")
        release.set()
        # Then the real worker runs it, an hour early, and the others keep waiting
        wait_for(lambda: count(db, f"SELECT count(*) FROM dramatiq.history WHERE id = {row_id}") == 1, 30,
                 "the message run now")  # fmt: skip
        assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE actor_name = 'archive'") == 104
    finally:
        release.set()


def test_the_queues_page_shows_counts_moving_in_place_under_a_strict_policy(
    make_broker: Any, db: Any, serve_dashboard: Callable[..., DashboardServer], page: Any
) -> None:
    # Given three orders waiting, and a dashboard whose live pages update every second
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="orders")
    def place(i: int) -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name="invoices")
    def invoice(i: int) -> None:
        pass

    for i in range(3):
        place.send(i)
    server = serve_dashboard(refresh=1)
    documents, updates, problems = watch(page)

    # When the operator opens the queues page, and four more orders and a first invoice arrive
    response = page.goto(server.url + "/")
    due = page.locator('tr[data-queue="orders"] td.num').first
    assert due.inner_text() == "3"
    assert page.locator("meta[http-equiv=refresh]").count() == 0  # in <noscript>: not for this browser
    page.evaluate("window.__marker = 1")
    for i in range(4):
        place.send(i)
    invoice.send(1)

    # Then the counts move on the page and the new queue's row appears, without a reload
    # (the marker set in the page survives; the page itself was loaded once)
    sync_api.expect(due).to_have_text("7", timeout=15_000)
    invoices = page.locator('tr[data-queue="invoices"] td.num').first
    sync_api.expect(invoices).to_have_text("1", timeout=15_000)
    assert page.evaluate("window.__marker") == 1
    assert documents == [server.url + "/"] and updates, (documents, updates)
    # And the policy lets only the dashboard's own script run, which breaks none of its rules
    csp = response.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "connect-src 'self';" in csp and "unsafe" not in csp
    assert problems == []

    # When the dashboard goes away
    server.stop()
    # Then the page says so, and keeps the last counts
    sync_api.expect(page.locator("#live-status")).to_have_text("connection lost, retrying", timeout=15_000)
    assert due.inner_text() == "7" and page.evaluate("window.__marker") == 1


def test_a_live_queue_page_keeps_what_the_operator_ticked_and_where_they_scrolled(
    make_broker: Any, db: Any, serve_dashboard: Callable[..., DashboardServer], page: Any
) -> None:
    # Given 150 exports delayed by an hour on one queue, and a dashboard updating every second
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="exports")
    def export(i: int) -> None:
        pass

    for i in range(150):
        export.send_with_options(args=(i,), delay=3_600_000)
    server = serve_dashboard(refresh=1)
    documents, _, problems = watch(page)
    page.goto(server.url + "/queues/exports")
    page.evaluate("window.__marker = 1")

    # When the operator ticks the purge confirmation, scrolls down to the messages, and ten more
    # exports arrive
    page.check("input[name=confirm]")
    page.evaluate("window.scrollTo(0, 1500)")
    scrolled = page.evaluate("window.scrollY")
    assert scrolled == 1500
    for i in range(10):
        export.send_with_options(args=(i,), delay=3_600_000)

    # Then the page shows them, and the box is still ticked, the page where it was scrolled to
    sync_api.expect(page.locator("button#purge")).to_have_text("Purge 160 waiting message(s)", timeout=15_000)
    assert page.is_checked("input[name=confirm]")
    assert page.evaluate("window.scrollY") == scrolled
    assert page.evaluate("window.__marker") == 1 and documents == [server.url + "/queues/exports"]

    # When the operator is choosing a filter (its drop-down has the focus) as ten more arrive
    page.focus("select[name=status]")
    for i in range(10):
        export.send_with_options(args=(i,), delay=3_600_000)
    # Then the updates leave the page alone until the operator is done with it
    updates = live_updates(page)
    wait_for(lambda: live_updates(page) >= updates + 2, 10, "two updates of the page")
    assert page.inner_text("button#purge") == "Purge 160 waiting message(s)"
    page.evaluate("document.activeElement.blur()")
    sync_api.expect(page.locator("button#purge")).to_have_text("Purge 170 waiting message(s)", timeout=15_000)
    assert page.is_checked("input[name=confirm]") and problems == []


def test_without_javascript_a_live_page_still_reloads_itself(
    db: Any, serve_dashboard: Callable[..., DashboardServer], browser: Any
) -> None:
    # Given a dashboard whose live pages update every second, and a browser that runs no script
    server = serve_dashboard(refresh=1)
    page = browser.new_context(java_script_enabled=False).new_page()
    documents, updates, _ = watch(page)

    # When the operator opens the workers page
    page.goto(server.url + "/workers")

    # Then its <noscript> refresh reloads it whole, over and over, as before the script
    assert page.locator("meta[http-equiv=refresh]").count() == 1
    wait_for(lambda: page.wait_for_timeout(50) or len(documents) >= 3, 15, "two reloads of the page")
    assert set(documents) == {server.url + "/workers"} and updates == []


def test_dead_letters_are_discarded_and_a_schedule_disabled_from_the_browser(
    make_broker: Any,
    start_worker: Any,
    db: Any,
    serve_dashboard: Callable[..., DashboardServer],
    page: Any,
    tmp_path: Path,
) -> None:
    from dramatiq_pg_outbox.periodic import Scheduler, periodic

    # Given three dead letters and a real scheduler with one schedule every minute
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="imports", max_retries=0)
    def load(i: int) -> None:
        raise ValueError(f"row {i} is malformed")

    @periodic(every=60_000, name="heartbeat-ping")
    @dramatiq.actor(broker=broker, queue_name="pings")
    def ping() -> None:
        pass

    for i in range(3):
        load.send(i)
    start_worker(broker)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 3, 30,
             "the dead letters")  # fmt: skip
    db.execute("DELETE FROM dramatiq.schedules")
    scheduler = Scheduler(broker)
    scheduler.sync()
    server = serve_dashboard()

    # When the operator ticks one dead letter and clicks Discard without confirming
    page.goto(server.url + "/failed")
    page.locator("#failed tbody input[name=ids]").first.check()
    page.click("#discard-selected")
    # Then nothing is deleted
    assert "Not discarded" in page.inner_text(".flash")
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 3
    # When confirmed
    page.locator("#failed tbody input[name=ids]").first.check()
    page.check("input[name=confirm]")
    page.click("#discard-selected")
    # Then that one is gone for good, the others stay
    assert "Discarded 1 dead letter(s) for good." in page.inner_text(".flash")
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 2
    assert page.locator("#failed tbody tr").count() == 2

    # When the operator opens the schedules and disables the schedule
    page.goto(server.url + "/schedules?refresh=off")
    row = page.locator('#schedules tr[data-name="heartbeat-ping"]')
    assert "enabled" in row.locator("td.status").inner_text()
    assert "every 1 min 00 s" in row.inner_text()
    row.locator("button:has-text('Disable')").click()
    assert "Disabled schedule heartbeat-ping." in page.inner_text(".flash")
    screenshot(page, tmp_path / "schedules.png")
    # Then the scheduler claims none of its ticks, even a due one: the tick that opened this
    # minute (ticks fall on whole minutes; past second 40 the test waits for the next minute, so
    # that the tick after it stays out of reach of the passes below, as it did not in one CI run)
    seconds = count(db, "SELECT floor(extract(second FROM now()))::int")
    time.sleep(60 - seconds if seconds >= 40 else 0)
    db.execute("UPDATE dramatiq.schedules SET next_run_at = date_trunc('minute', now())")
    assert scheduler.run_once().claimed == 0
    assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'pings'") == 0
    # And once enabled again, the due tick is enqueued (the next one is a minute away)
    page.locator('#schedules tr[data-name="heartbeat-ping"] button:has-text("Enable")').click()
    assert "Enabled schedule heartbeat-ping." in page.inner_text(".flash")
    # And the Audit page lists each action, newest first, with who (no auth here: anonymous) and where from
    page.click("nav >> text=Audit")
    actions = [cell.inner_text() for cell in page.locator("#audit td.action").all()]
    assert actions[:3] == ["schedule-enable", "schedule-disable", "discard"], actions
    newest = page.locator("#audit tbody tr").first.inner_text()
    assert "anonymous" in newest and "from 127.0.0.1" in newest
    screenshot(page, tmp_path / "audit.png")
    assert scheduler.run_once().enqueued == 1
    assert (
        count(db, "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'pings'")
        + count(db, "SELECT count(*) FROM dramatiq.history WHERE queue_name = 'pings'")
        == 1
    )
