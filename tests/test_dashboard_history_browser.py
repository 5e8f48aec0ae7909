"""History in a real browser (Debian's Chromium through Playwright): a support ticket's customer id
leads to the message that served it, and from there to each of its deliveries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import dramatiq

from tests.dashboard_support import DashboardServer, serve_dashboard
from tests.helpers import count, wait_for
from tests.test_dashboard_browser import browser, page, screenshot

__all__ = ["browser", "page", "serve_dashboard"]  # the fixtures, imported for pytest


class MailboxFull(Exception):
    pass


def test_an_operator_finds_a_customers_message_by_its_arguments_and_opens_its_deliveries(
    make_broker: Any,
    start_worker: Any,
    db: Any,
    serve_dashboard: Callable[..., DashboardServer],
    page: Any,
    tmp_path: Path,
) -> None:
    # Given a welcome mail that failed once and then went out, among mails to other customers
    broker = make_broker()
    tries: dict[str, int] = {}

    @dramatiq.actor(broker=broker, max_retries=2, min_backoff=10, max_backoff=20)
    def send_welcome(customer: str, locale: str = "en") -> None:
        tries[customer] = tries.get(customer, 0) + 1
        if customer == "cust-5150" and tries[customer] == 1:
            raise MailboxFull(f"mailbox of {customer} is full")

    for customer in ("cust-1", "cust-5150", "cust-2"):
        send_welcome.send(customer, locale="fr")
    start_worker(broker)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history") == 4, 30, "four deliveries")
    server = serve_dashboard()

    # When an operator searches the history for the customer id of a support ticket
    page.goto(server.url + "/")
    page.click("nav a:has-text('History')")
    page.fill("input[name=args]", "cust-5150")
    page.click("#history-filters button[type=submit]")
    page.wait_for_selector("#history")

    # Then both deliveries of that message are listed, newest first, and no other customer's
    outcomes = page.locator("#history tbody tr").evaluate_all("rows => rows.map(r => r.dataset.outcome)")
    assert outcomes == ["completed", "retried"], outcomes
    assert "cust-1" not in page.inner_text("#history") and '"cust-5150"' in page.inner_text("#history")
    screenshot(page, tmp_path / "history.png")
    # and the completed one's page lists both deliveries, the failed attempt with its error
    page.click("#history tbody tr:first-child td a")
    page.wait_for_selector("#delivery-list")
    assert page.inner_text("#outcome") == "completed"
    deliveries = page.inner_text("#delivery-list")
    assert "MailboxFull: mailbox of cust-5150 is full" in deliveries and "(this one)" in deliveries
    # from which the failed attempt's own page opens, with its traceback
    page.click("#delivery-list tbody tr:first-child td a")
    assert "Traceback (most recent call last):" in page.inner_text("pre.traceback")
    screenshot(page, tmp_path / "finished.png")
