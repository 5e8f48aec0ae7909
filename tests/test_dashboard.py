"""The web dashboard over HTTP: a real uvicorn server, a real PostgreSQL, real Dramatiq workers."""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.cli import main
from dramatiq_pg_outbox.dashboard import TOKEN_ENV, charts
from dramatiq_pg_outbox.dashboard.app import Settings
from dramatiq_pg_outbox.dashboard.security import load_users, secret_digest
from dramatiq_pg_outbox.dashboard.store import SHARED_QUERIES, Store, raw_queries
from dramatiq_pg_outbox.formats import error_parts, format_age, format_time
from dramatiq_pg_outbox.migrations import libpq_url
from dramatiq_pg_outbox.testing import free_port
from tests.dashboard_support import DashboardServer, csrf_token, serve_dashboard
from tests.helpers import count, wait_for

httpx = pytest.importorskip("httpx", reason="httpx is not installed: pip install -e '.[dev]'")

__all__ = ["serve_dashboard"]  # the fixture, imported for pytest

ROOT = Path(__file__).resolve().parent.parent
Serve = Callable[..., DashboardServer]


class CardDeclined(Exception):
    pass


def failing_actors(broker: PostgresBroker) -> tuple[Any, Any]:
    """``charge`` fails for odd orders (no retries); ``ship`` on queue ``shipping`` always works."""

    @dramatiq.actor(broker=broker, max_retries=0)
    def charge(order: int, note: str = "") -> None:
        if order % 2:
            raise CardDeclined(f"card declined for order {order} {note}")

    @dramatiq.actor(broker=broker, queue_name="shipping")
    def ship(order: int) -> None:
        pass

    return charge, ship


def run_until_finished(broker: PostgresBroker, start_worker: Any, db: Any, expected: int) -> Any:
    worker = start_worker(broker)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history") >= expected, 30, "the history rows")
    return worker


def dead_letter_ids(db: Any) -> list[int]:
    return [r[0] for r in db.execute("SELECT id FROM dramatiq.history WHERE state = 'failed' ORDER BY id")]


# -- pages --------------------------------------------------------------------
def test_pages_show_the_queues_workers_dead_letters_and_charts_of_the_database(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given 4 orders charged (2 fail), 3 shipped, one shipment delayed by an hour, a live worker
    broker = make_broker()
    charge, ship = failing_actors(broker)
    for order in range(4):
        charge.send(order)
    for order in range(3):
        ship.send(order)
    run_until_finished(broker, start_worker, db, 7)
    ship.send_with_options(args=(99,), delay=3_600_000)
    server = serve_dashboard()

    # When the pages are read
    queues = httpx.get(server.url + "/").text
    workers = httpx.get(server.url + "/workers").text
    failed = httpx.get(server.url + "/failed").text
    first = dead_letter_ids(db)[0]
    letter = httpx.get(f"{server.url}/failed/{first}").text
    shipping = httpx.get(server.url + "/queues/shipping").text
    chart_page = httpx.get(server.url + "/charts?window=15m").text

    # Then each shows what the tables hold
    row = re.search(r'<tr data-queue="default">(.*?)</tr>', queues, re.S)
    assert row, queues
    cells = re.findall(r'<td class="num[^"]*">([^<]*)<', row.group(1))
    # due, delayed, processing, oldest due, completed (1 h), failed (1 h)
    assert cells[:3] == ["0", "0", "0"] and cells[4:6] == ["2", "2"], cells
    assert ">2</a>" in row.group(1)  # dead letters, linked to the failed page
    shipping_row = re.search(r'<tr data-queue="shipping">(.*?)</tr>', queues, re.S)
    assert shipping_row and re.findall(r'<td class="num[^"]*">([^<]*)<', shipping_row.group(1))[:2] == [
        "0",
        "1",
    ]
    assert "<rect " in row.group(1)  # the last hour's sparkline has a bar

    assert socket.gethostname() in workers and f">{os.getpid()}<" in workers
    assert (
        "2 dead letter(s)" in failed and failed.count("CardDeclined</strong>: card declined for order") == 2
    )
    assert "Traceback (most recent call last):" in letter
    assert "raise CardDeclined(" in letter
    assert "&#34;actor_name&#34;: &#34;charge&#34;" in letter  # the decoded JSON payload
    assert ">delayed</td>" in shipping
    assert 'id="throughput"' in chart_page and "<polyline" in chart_page
    assert chart_page.count("<figcaption>charge") == 1 and chart_page.count("<figcaption>ship") == 1


def test_the_failed_page_filters_by_queue_actor_error_type_and_text(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given dead letters of two actors with two error types
    broker = make_broker()
    charge, _ = failing_actors(broker)

    @dramatiq.actor(broker=broker, queue_name="mail", max_retries=0)
    def mail(to: str) -> None:
        raise ConnectionRefusedError(f"smtp refused {to}")

    charge.send(1, "gift")
    charge.send(3, "")
    mail.send("ann@example.com")
    run_until_finished(broker, start_worker, db, 3)
    server = serve_dashboard()

    def listed(query: str) -> set[str]:
        html = httpx.get(f"{server.url}/failed?{query}").text
        return set(re.findall(r'<td class="error-line"><strong>([^<]*)</strong>', html))

    # Then each filter narrows the list
    assert listed("") == {"CardDeclined", "ConnectionRefusedError"}
    assert listed("actor=mail") == {"ConnectionRefusedError"}
    assert listed("queue=default") == {"CardDeclined"}
    assert listed("error_type=CardDeclined") == {"CardDeclined"}
    assert listed("q=GIFT") == {"CardDeclined"}
    assert "1 dead letter(s) match" in httpx.get(f"{server.url}/failed?q=gift").text
    assert listed("actor=mail&error_type=CardDeclined") == set()


# -- auth, CSRF, read-only ----------------------------------------------------
def test_a_token_dashboard_answers_401_without_the_token_and_200_with_it(
    db: Any, serve_dashboard: Serve
) -> None:
    server = serve_dashboard(token="s3cret-token")

    assert httpx.get(server.url + "/").status_code == 401
    assert httpx.get(server.url + "/failed", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert (
        httpx.get(server.url + "/failed", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    )
    assert httpx.get(server.url + "/healthz").status_code == 200  # for load balancers; shows nothing

    # The login form (with its CSRF token) marks the browser session as logged in.
    with httpx.Client(base_url=server.url) as browser:
        page = browser.get("/workers")
        assert page.status_code == 401 and 'name="token"' in page.text
        wrong = browser.post(
            "/login", data={"csrf_token": csrf_token(page.text), "token": "nope", "next": "/"}
        )
        assert wrong.status_code == 401
        right = browser.post("/login", data={"csrf_token": csrf_token(wrong.text), "token": "s3cret-token",
                                             "next": "/workers"})  # fmt: skip
        assert right.status_code == 303 and right.headers["location"] == "/workers"
        assert browser.get("/workers").status_code == 200


def test_the_login_form_only_sends_back_to_a_page_of_the_dashboard(db: Any, serve_dashboard: Serve) -> None:
    server = serve_dashboard(token="t")
    targets = []
    for next_page in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "/failed?q=x"):
        with httpx.Client(base_url=server.url) as browser:
            token = csrf_token(browser.get("/login").text)
            done = browser.post("/login", data={"csrf_token": token, "token": "t", "next": next_page})
            targets.append(done.headers["location"])
    assert targets == ["/", "/", "/", "/failed?q=x"]


def test_a_basic_auth_dashboard_answers_401_with_a_challenge_and_200_with_the_password(
    db: Any, serve_dashboard: Serve
) -> None:
    server = serve_dashboard(basic_auth=("ops", "pa:ss"))

    def basic(user: str, password: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    denied = httpx.get(server.url + "/")
    assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic ")
    assert httpx.get(server.url + "/", headers=basic("ops", "wrong")).status_code == 401
    assert httpx.get(server.url + "/", headers=basic("other", "pa:ss")).status_code == 401
    assert httpx.get(server.url + "/", headers=basic("ops", "pa:ss")).status_code == 200
    assert httpx.post(server.url + "/failed/retry", data={"all": "1"}).status_code == 401


def test_an_action_without_the_csrf_token_of_its_session_is_refused_with_403(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given a dead letter and a browser session with its CSRF token
    broker = make_broker()
    charge, _ = failing_actors(broker)
    charge.send(1)
    run_until_finished(broker, start_worker, db, 1)
    server = serve_dashboard()
    with httpx.Client(base_url=server.url) as browser, httpx.Client(base_url=server.url) as attacker:
        token = csrf_token(browser.get("/failed").text)
        other_session_token = csrf_token(attacker.get("/failed").text)

        # When the retry is posted without a token, with a wrong one, or with another session's
        responses = [
            browser.post("/failed/retry", data={"all": "1"}),
            browser.post("/failed/retry", data={"all": "1", "csrf_token": "forged"}),
            browser.post("/failed/retry", data={"all": "1", "csrf_token": other_session_token}),
            attacker.post("/failed/retry", data={"all": "1", "csrf_token": token}),
        ]
        # Then each is refused and nothing moved
        assert [r.status_code for r in responses] == [403, 403, 403, 403]
        assert "CSRF" in responses[0].text
        assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 1

        # And with its own token the same request works
        assert browser.post("/failed/retry", data={"all": "1", "csrf_token": token}).status_code == 303
        assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 0


def test_a_read_only_dashboard_hides_the_actions_and_refuses_them_with_403(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given a dead letter, a waiting message and a read-only dashboard (token auth, so a
    # valid CSRF token is at hand in the logout form)
    broker = make_broker()
    charge, ship = failing_actors(broker)
    charge.send(1)
    run_until_finished(broker, start_worker, db, 1)
    for worker in make_broker.workers:
        worker.stop()
    make_broker.workers.clear()
    ship.send(7)
    waiting = count(db, "SELECT id FROM dramatiq.messages")
    dead = dead_letter_ids(db)[0]
    server = serve_dashboard(read_only=True, token="t")
    auth = {"Authorization": "Bearer t"}
    with httpx.Client(base_url=server.url, headers=auth) as browser:
        pages = [
            browser.get(p).text
            for p in ("/failed", f"/failed/{dead}", "/queues/shipping", f"/messages/{waiting}", "/schedules")
        ]
        token = csrf_token(pages[0])

        # Then no page offers an action
        for html in pages:
            assert "Retry" not in html and "Purge" not in html and "Cancel" not in html
            assert "Discard" not in html and "Run now" not in html and "Disable" not in html
            assert 'action="' + server.url + '/failed/retry"' not in html

        # And every action is refused, although auth and CSRF are right
        refused = [
            browser.post("/failed/retry", data={"csrf_token": token, "ids": str(dead)}),
            browser.post("/queues/shipping/purge", data={"csrf_token": token, "confirm": "yes"}),
            browser.post(f"/messages/{waiting}/cancel", data={"csrf_token": token}),
            browser.post("/failed/discard", data={"csrf_token": token, "ids": str(dead), "confirm": "yes"}),
            browser.post(f"/messages/{waiting}/run-now", data={"csrf_token": token}),
            browser.post("/schedules/toggle", data={"csrf_token": token, "name": "x", "enabled": "0"}),
            browser.post("/schedules/run-now", data={"csrf_token": token, "name": "x"}),
        ]
    assert [r.status_code for r in refused] == [403] * 7
    assert "read-only" in refused[0].text
    assert dead_letter_ids(db) == [dead]
    assert count(db, "SELECT count(*) FROM dramatiq.messages") == 1


def test_a_script_in_stored_values_is_shown_as_text(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given an actor that fails with markup in its error, and a history row whose
    # every text column holds markup (written directly, as anyone with INSERT could)
    broker = make_broker()
    charge, _ = failing_actors(broker)
    charge.send(1, "<script>alert('error')</script>")
    run_until_finished(broker, start_worker, db, 1)
    evil = "<img src=x onerror=alert(1)>"
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, "
        "enqueued_at, started_at, error_type, error, payload) "
        "VALUES (424242, 'default', %s, %s, 'failed', 1, now(), now(), %s, %s, %s)",
        (
            evil,
            evil,
            evil,
            "Traceback\n<script>alert('traceback')</script>",
            b'{"args": ["<script>x</script>"]}',
        ),
    )
    server = serve_dashboard()

    # When every page that shows these values is read
    pages = {
        path: httpx.get(server.url + path).text
        for path in (
            "/",
            "/failed",
            f"/failed/{dead_letter_ids(db)[0]}",
            "/failed/424242",
            "/charts?window=15m",
        )
    }
    # Then no markup from the database reaches the page unescaped (the one script is the
    # dashboard's own file, on its live pages)
    own_script = f'<script src="{server.url}/static/live.js" defer></script>'
    assert own_script in pages["/"]
    for path, html in pages.items():
        assert "<script" not in html.replace(own_script, ""), path
        assert "<img src=x" not in html, path
    assert "&lt;script&gt;alert(&#39;error&#39;)&lt;/script&gt;" in pages["/failed"]
    assert "&lt;script&gt;alert(&#39;traceback&#39;)&lt;/script&gt;" in pages["/failed/424242"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in pages["/failed/424242"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in pages["/charts?window=15m"]  # chart title and tables
    # And no other script may run at all (second line of defence)
    csp = csp_directives(httpx.get(server.url + "/failed").headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"] and csp["script-src"] == ["'self'"]


def csp_directives(header: str) -> dict[str, list[str]]:
    """A Content-Security-Policy header as {directive: its sources}."""
    parts = [part.split() for part in header.split(";") if part.strip()]
    return {part[0]: part[1:] for part in parts}


def test_a_live_page_updates_itself_with_its_own_script_or_reloads_without_it(
    db: Any, serve_dashboard: Serve
) -> None:
    # Given a dashboard whose live pages update every 3 s
    server = serve_dashboard(refresh=3)

    # When a live page is read
    response = httpx.get(server.url + "/")
    html = response.text
    # Then it loads the dashboard's script, which updates its marked region in place, and a
    # browser without JavaScript reloads it instead
    assert f'<script src="{server.url}/static/live.js" defer></script>' in html
    assert '<noscript><meta http-equiv="refresh" content="3"></noscript>' in html
    assert '<body data-refresh="3">' in html and '<div id="live" data-live>' in html
    assert html.count("http-equiv") == 1
    # And the script is served, and may run under the page's policy: scripts of this origin
    # only (no inline script, no eval), fetches to it only
    script = httpx.get(f"{server.url}/static/live.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "fetch(window.location.href" in script.text and "eval(" not in script.text
    csp = csp_directives(response.headers["content-security-policy"])
    assert csp["script-src"] == ["'self'"] and csp["connect-src"] == ["'self'"]
    assert csp["default-src"] == ["'none'"] and "unsafe" not in response.headers["content-security-policy"]
    # And a paused page (?refresh=off) or a page that is not live has neither
    for path in ("/?refresh=off", "/failed", "/charts"):
        other = httpx.get(server.url + path).text
        assert "<script" not in other and "http-equiv" not in other and "data-live" not in other, path
        assert "data-refresh" not in other, path

    # When an action flashes its outcome and a live update of the page comes before the operator's
    # next page
    with httpx.Client(base_url=server.url) as client:
        token = csrf_token(client.get("/queues/default").text)  # its Pause button's form
        done = client.post("/failed/retry", data={"csrf_token": token})
        assert done.status_code == 303
        update = client.get("/failed", headers={"X-Live": "1"}).text
        shown = client.get("/failed").text
    # Then the update leaves the message to the page the operator sees
    assert "Nothing selected" not in update
    assert "Nothing selected: tick the dead letters to retry." in shown


# -- actions ------------------------------------------------------------------
def test_retry_moves_dead_letters_back_with_fresh_attempts_and_a_worker_runs_them(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given three dead letters of a flaky actor that now works, and no worker running
    broker = make_broker()
    broken = {"yes": True}

    @dramatiq.actor(broker=broker, max_retries=0)
    def flaky(n: int) -> None:
        if broken["yes"]:
            raise RuntimeError(f"down for {n}")

    for n in range(3):
        flaky.send(n)
    worker = run_until_finished(broker, start_worker, db, 3)
    worker.stop()
    make_broker.workers.remove(worker)
    first, second, third = dead_letter_ids(db)
    server = serve_dashboard()

    with httpx.Client(base_url=server.url) as browser:
        token = csrf_token(browser.get("/failed").text)
        # When two are retried by id
        done = browser.post("/failed/retry", data={"csrf_token": token, "ids": [str(first), str(second)]})
        assert done.status_code == 303
        assert "Re-enqueued 2 dead letter(s): 2 on default." in browser.get(done.headers["location"]).text

    # Then they are waiting again, due now, with a fresh attempts count, and the third is untouched
    rows = db.execute(
        "SELECT state, attempts, next_attempt_at <= now() FROM dramatiq.messages ORDER BY id"
    ).fetchall()
    assert rows == [("pending", 0, True), ("pending", 0, True)]
    assert dead_letter_ids(db) == [third]

    # And a worker runs them to completion
    broken["yes"] = False
    start_worker(broker)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'completed'") == 2, 30,
             "the retried messages to complete")  # fmt: skip
    assert count(db, "SELECT count(*) FROM dramatiq.messages") == 0


def test_retry_all_matching_retries_only_what_the_filter_shows(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    broker = make_broker()
    charge, _ = failing_actors(broker)
    charge.send(1, "gift")
    charge.send(3, "plain")
    charge.send(5, "gift")
    worker = run_until_finished(broker, start_worker, db, 3)
    worker.stop()
    make_broker.workers.remove(worker)
    server = serve_dashboard()

    with httpx.Client(base_url=server.url) as browser:
        token = csrf_token(browser.get("/failed?q=gift").text)
        browser.post("/failed/retry", data={"csrf_token": token, "all": "1", "q": "gift", "actor": "charge"})

    assert count(db, "SELECT count(*) FROM dramatiq.messages") == 2
    remaining = db.execute("SELECT error FROM dramatiq.history WHERE state = 'failed'").fetchall()
    assert len(remaining) == 1 and "plain" in remaining[0][0]


def test_retry_wakes_the_workers_of_the_queue(
    make_broker: Any, start_worker: Any, db: Any, database_url: str, serve_dashboard: Serve
) -> None:
    # Given a dead letter and a connection listening on the broker's channel
    broker = make_broker()
    charge, _ = failing_actors(broker)
    charge.send(1)
    run_until_finished(broker, start_worker, db, 1)
    server = serve_dashboard()
    with psycopg.connect(libpq_url(database_url), autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        # When it is retried
        with httpx.Client(base_url=server.url) as browser:
            token = csrf_token(browser.get("/failed").text)
            browser.post("/failed/retry", data={"csrf_token": token, "ids": str(dead_letter_ids(db)[0])})
        # Then the workers of its queue are woken
        payloads = [n.payload for n in listener.notifies(timeout=10, stop_after=1)]
    assert payloads == ["default"]


def test_purge_deletes_the_waiting_messages_of_one_queue_and_leaves_the_running_ones(
    make_broker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given waiting (due and delayed) and running messages on "shipping" and one on "default"
    broker = make_broker()
    charge, ship = failing_actors(broker)
    for order in range(3):
        ship.send(order)
    ship.send_with_options(args=(9,), delay=3_600_000)
    charge.send(2)
    db.execute(
        "UPDATE dramatiq.messages SET state = 'processing', lease = gen_random_uuid(), acquired_at = now() "
        "WHERE id = (SELECT min(id) FROM dramatiq.messages)"
    )
    server = serve_dashboard()
    with httpx.Client(base_url=server.url) as browser:
        token = csrf_token(browser.get("/queues/shipping").text)
        # When a purge is posted without ticking the confirmation, nothing happens
        browser.post("/queues/shipping/purge", data={"csrf_token": token})
        assert count(db, "SELECT count(*) FROM dramatiq.messages") == 5
        # When it is confirmed
        done = browser.post("/queues/shipping/purge", data={"csrf_token": token, "confirm": "yes"})
        assert (
            "Purged 3 waiting message(s) from queue shipping." in browser.get(done.headers["location"]).text
        )

    # Then only the running shipment and the other queue's message remain
    assert db.execute("SELECT queue_name, state FROM dramatiq.messages ORDER BY id").fetchall() == [
        ("shipping", "processing"),
        ("default", "pending"),
    ]


def test_cancel_archives_a_waiting_message_as_canceled_and_marks_a_running_one_for_its_worker(
    make_broker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given a delayed message and a running one
    broker = make_broker()
    _, ship = failing_actors(broker)
    ship.send_with_options(args=(1,), delay=3_600_000)
    ship.send(2)
    delayed, running = [r[0] for r in db.execute("SELECT id FROM dramatiq.messages ORDER BY id")]
    db.execute(
        "UPDATE dramatiq.messages SET state = 'processing', lease = gen_random_uuid(), acquired_at = now() "
        "WHERE id = %s",
        (running,),
    )
    server = serve_dashboard()
    with httpx.Client(base_url=server.url) as browser:
        page = browser.get(f"/messages/{running}").text
        assert "Cancel this message" in page and "interrupts the actor" in page
        token = csrf_token(page)
        # When both are canceled
        browser.post(f"/messages/{delayed}/cancel", data={"csrf_token": token})
        told = browser.post(f"/messages/{running}/cancel", data={"csrf_token": token})
        assert "Canceling message" in browser.get(told.headers["location"]).text

        # Then the waiting one is in history as canceled (error type Canceled), not a dead letter
        assert db.execute("SELECT id, queue_name, state, error_type FROM dramatiq.history").fetchall() == [
            (delayed, "shipping", "canceled", "Canceled")
        ]
        assert "Canceled" not in browser.get("/failed?error_type=Canceled").text.split("<table", 1)[-1]
        assert "canceled</strong> by an operator" in browser.get(f"/messages/{delayed}").text
        # And the running one is marked for its worker (which the rescuer stands for here: no owner)
        assert db.execute(
            "SELECT id, state, cancel_requested_at IS NOT NULL,"
            " cancel_reason LIKE 'canceled from the dashboard%%' FROM dramatiq.messages"
        ).fetchall() == [(running, "processing", True, True)]
        # And the cancel is counted as canceled, not as a dead letter
        assert count(db, "SELECT count(*) FROM dramatiq.dead_letter_counts") == 0
        assert db.execute("SELECT state, n FROM dramatiq.finished_counts").fetchall() == [("canceled", 1)]

        # And a retry of the failed page leaves it where it is; a second cancel says it finished
        browser.post("/failed/retry", data={"csrf_token": token, "ids": str(delayed)})
        again = browser.post(f"/messages/{delayed}/cancel", data={"csrf_token": token})
        assert "already finished (canceled)" in browser.get(again.headers["location"]).text
    assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE state = 'pending'") == 0
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'canceled'") == 1


def test_a_queue_name_with_a_trailing_newline_is_not_a_queue(db: Any, serve_dashboard: Serve) -> None:
    # Given a dashboard ("shipping\n" passes a ``^...$`` rule checked with ``match``)
    server = serve_dashboard()
    with httpx.Client(base_url=server.url) as browser:
        # When the page of a queue and of that queue with a final newline are asked for
        # Then only the first is a queue
        assert browser.get("/queues/shipping").status_code == 200
        assert browser.get("/queues/shipping%0A").status_code == 404


def test_a_page_says_503_when_the_database_does_not_answer(serve_dashboard: Serve) -> None:
    # Given a dashboard whose database is on a port where nothing listens
    url = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nowhere"
    server = serve_dashboard(url=url, store=Store(url, "dramatiq", "unused", timeout=1))
    # When a page and the health check are asked for
    page = httpx.get(server.url + "/", timeout=30)
    health = httpx.get(server.url + "/healthz", timeout=30)
    # Then both say so, without the password
    assert page.status_code == 503 and "The database did not answer" in page.text
    assert health.status_code == 503
    assert "secret" not in page.text


# -- the command --------------------------------------------------------------
def test_the_command_serves_with_the_token_from_the_environment_out_of_sight_of_ps(
    database_url: str, db: Any
) -> None:
    port = free_port()
    env = {**os.environ, TOKEN_ENV: "from-the-environment"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dramatiq_pg_outbox.cli",
            "dashboard",
            "--url",
            database_url,
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/healthz").status_code == 200
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read() if process.stdout else ""
                return False

        wait_for(up, 60, "the dashboard command to serve")
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"from-the-environment" not in cmdline
        assert httpx.get(url + "/").status_code == 401
        assert (
            httpx.get(url + "/", headers={"Authorization": "Bearer from-the-environment"}).status_code == 200
        )
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0].decode()
    assert f"on http://127.0.0.1:{port}/" in output and "auth: token" in output
    # A graceful stop: uvicorn finishes the lifespan (the pool closes), then re-raises SIGTERM.
    assert "Application shutdown complete." in output
    assert process.returncode in (0, -signal.SIGTERM)


@pytest.mark.parametrize(
    ("argv", "env", "code", "expected"),
    [
        (
            ["--schema", "never_migrated"],
            {},
            1,
            "Run: dramatiq-pg-outbox migrate --url {url} --schema never_migrated",
        ),
        (["--basic-auth", "no-colon"], {}, 2, "basic auth must be USER:PASSWORD"),
        (["--schema", "bad-name"], {}, 2, "Invalid schema name"),
        ([], {TOKEN_ENV: "a", "DRAMATIQ_PG_OUTBOX_DASHBOARD_BASIC_AUTH": "u:p"}, 2, "choose one"),
        (["--host", "0.0.0.0"], {}, 2, "name the host names browsers use, e.g. --allowed-host"),
    ],
)
def test_the_command_refuses_bad_input_with_one_line(
    database_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    argv: list[str], env: dict[str, str], code: int, expected: str,
) -> None:  # fmt: skip
    from dramatiq_pg_outbox.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["dashboard", "--url", database_url, "--port", "0", *argv]) == code
    err = capsys.readouterr().err
    assert expected.format(url=database_url) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_command_without_a_url_says_how_to_give_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dramatiq_pg_outbox.cli import main

    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert main(["dashboard"]) == 2
    assert "no database URL: pass --url postgresql://" in capsys.readouterr().err


def test_the_command_reads_the_url_from_the_environment(
    database_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dramatiq_pg_outbox.cli import main

    # Given $DATABASE_URL and a schema that was never migrated
    monkeypatch.setenv("DATABASE_URL", database_url)
    # When the dashboard starts without --url
    code = main(["dashboard", "--port", "0", "--schema", "never_migrated"])
    # Then it checked that database, and the fix names the variable rather than its value
    err = capsys.readouterr().err
    assert code == 1 and 'migrate --url "$DATABASE_URL" --schema never_migrated' in err, err


def test_the_command_says_in_one_line_that_its_port_is_taken(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from dramatiq_pg_outbox.cli import main

    # Given a port something else listens on
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # When the dashboard is asked to serve on it
        code = main(["dashboard", "--url", database_url, "--port", str(port)])
    # Then it stops with one line that says which and what to do, as metrics does
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.splitlines() == [
        f"dramatiq-pg-outbox dashboard: error: cannot listen on 127.0.0.1:{port}: "
        "Address already in use. Choose another --port"
    ]


def test_the_command_serves_a_schema_at_revision_3_on_purpose(database_url: str) -> None:
    # Given a schema left at revision 3 (the analytics views the dashboard reads), with a dead letter
    schema = f"dash_rev3_{os.urandom(4).hex()}"
    upgrade(database_url, schema=schema, revision="0003")
    process: subprocess.Popen[str] | None = None
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO {schema}.history (id, queue_name, actor_name, message_id, state, attempts, "
                "enqueued_at, error_type, error, payload) VALUES (1, 'default', 'charge', 'm-1', 'failed', "
                "1, now(), 'CardDeclined', 'CardDeclined: card declined for order 1', '{}')"
            )
        # When the dashboard command is started on it (port 0: the kernel picks one, printed)
        process = subprocess.Popen(
            [sys.executable, "-m", "dramatiq_pg_outbox.cli", "dashboard", "--url", database_url,
             "--schema", schema, "--port", "0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert process.stdout is not None
        first = process.stdout.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/$", first.strip())
        assert found, first
        url = found.group(1)

        def up() -> bool:
            try:
                return httpx.get(url + "/healthz").status_code == 200
            except httpx.TransportError:
                assert process is not None and process.poll() is None
                return False

        wait_for(up, 60, "the dashboard command to serve")
        # Then every page reads it, and a retry moves the dead letter back to its queue
        with httpx.Client(base_url=url) as browser:
            for page in ("/", "/workers", "/charts", "/failed/1", "/schedules", "/queues/default"):
                assert browser.get(page).status_code == 200, page
            failed = browser.get("/failed")
            assert failed.status_code == 200 and "card declined for order 1" in failed.text
            done = browser.post("/failed/retry", data={"csrf_token": csrf_token(failed.text), "ids": "1"})
            assert done.status_code == 303
        with psycopg.connect(database_url) as conn:
            assert count(conn, f"SELECT count(*) FROM {schema}.messages WHERE message_id = 'm-1'") == 1
            assert count(conn, f"SELECT count(*) FROM {schema}.history") == 0
    finally:
        if process is not None:
            process.terminate()
            process.communicate(timeout=30)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_the_workers_page_judges_workers_by_the_heartbeat_timeout_it_is_given(
    db: Any, serve_dashboard: Serve
) -> None:
    # Given a worker process whose last heartbeat is 30 s old
    db.execute(
        "INSERT INTO dramatiq.workers (id, hostname, pid, heartbeat_at) "
        "VALUES (gen_random_uuid(), 'quiet', 1, now() - interval '30 seconds')"
    )

    def heartbeat_cell(page: str) -> str:
        found = re.search(r'<td>quiet</td>.*?<td class="num([^"]*)">[^<]* ago</td>', page, re.S)
        assert found, page
        return found.group(1).strip()

    # When one dashboard judges by the broker's default (20 s) and one by the workers' 120 s
    default = httpx.get(serve_dashboard().url + "/workers").text
    patient = httpx.get(serve_dashboard(heartbeat_timeout=120_000).url + "/workers").text
    # Then the first shows it dead, the second alive and not even late (under half the timeout)
    assert heartbeat_cell(default) == "bad" and "(20 s, as this dashboard is configured)" in default
    assert heartbeat_cell(patient) == "" and "(120 s, as this dashboard is configured)" in patient


# -- pieces -------------------------------------------------------------------
def test_every_query_the_dashboard_runs_is_defined_once_in_its_sql_file() -> None:
    source = (ROOT / "dramatiq_pg_outbox" / "dashboard" / "store.py").read_text()
    used = set(re.findall(r'_(?:rows|tuples|rows_any_revision)\(\s*(?:\w+,\s*)?"([a-z_]+)"', source))
    used |= set(re.findall(r'self\.queries\["([a-z_]+)"\]', source))
    # (and the audit trail's, which come from admin.sql: the command line's text, see SHARED_QUERIES)
    assert used == set(raw_queries()) | set(SHARED_QUERIES), used ^ set(raw_queries())
    assert not set(SHARED_QUERIES) & set(raw_queries())


def test_a_negative_or_fractional_refresh_is_refused() -> None:
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="refresh must be a whole number of seconds >= 0"):
            Settings(url="postgresql://x/y", refresh=bad)


def test_a_heartbeat_timeout_below_one_millisecond_or_fractional_is_refused() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="heartbeat_timeout must be an integer >= 1"):
            Settings(url="postgresql://x/y", heartbeat_timeout=bad)


def test_nice_ticks_cover_the_maximum_in_round_steps() -> None:
    assert charts.nice_ticks(0) == [0, 0.25, 0.5, 0.75, 1.0]
    assert charts.nice_ticks(7.3) == [0, 2, 4, 6, 8]
    assert charts.nice_ticks(1234) == [0, 500, 1000, 1500]
    assert charts.nice_ticks(100) == [0, 25, 50, 75, 100]


def test_a_gap_in_a_series_breaks_its_line() -> None:
    import datetime as dt

    t0 = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.timezone.utc)
    points = [(t0 + dt.timedelta(minutes=i), v) for i, v in enumerate([1.0, 2.0, None, 4.0, None, 2.0, 3.0])]
    chart = charts.line_chart("t", "ms", [charts.Series("a", points)], t0, t0 + dt.timedelta(minutes=6))
    (line,) = chart.lines
    assert len(line.segments) == 2 and len(line.dots) == 1
    assert [label for _, label in chart.y_ticks] == ["0", "1", "2", "3", "4"]


def test_a_latency_axis_reads_in_human_units() -> None:
    import datetime as dt

    t0 = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.timezone.utc)

    def axis(peak_ms: float) -> tuple[str, list[str]]:
        points = [(t0, 0.0), (t0 + dt.timedelta(minutes=1), peak_ms)]
        chart = charts.line_chart("t", "ms", [charts.Series("a", points)], t0, t0 + dt.timedelta(minutes=2))
        return chart.unit, [label for _, label in chart.y_ticks]

    # A wait of 9.5 hours (34.2M ms) reads in hours, 3 days in days, 800 s in minutes
    assert axis(9.5 * 3_600_000) == ("h", ["0", "2.5", "5", "7.5", "10"])
    assert axis(3 * 86_400_000) == ("d", ["0", "1", "2", "3"])
    assert axis(800_000) == ("min", ["0", "5", "10", "15"])
    assert axis(42) == ("ms", ["0", "20", "40", "60"])
    assert axis(0) == ("ms", ["0", "0.25", "0.5", "0.75", "1"])
    # And the line's top point lies on the tick of its value (the scale is the unit's)
    points = [(t0, 0.0), (t0 + dt.timedelta(minutes=1), 2 * 3_600_000)]
    chart = charts.line_chart("t", "ms", [charts.Series("a", points)], t0, t0 + dt.timedelta(minutes=2))
    top_y = float(chart.lines[0].segments[0].split()[1].split(",")[1])
    assert (top_y, "2") in [(y, label) for y, label in chart.y_ticks]


def test_the_charts_count_an_empty_bucket_as_zero_messages_and_unknown_latency() -> None:
    import datetime as dt

    from dramatiq_pg_outbox.dashboard.store import StatRow

    # Given message_stats() rows of minute buckets: "busy" in minutes 0 and 2, "rare" in minute 1
    t0 = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.timezone.utc)

    def row(actor: str, minute: int, n: int) -> StatRow:
        start = t0 + dt.timedelta(minutes=minute)
        return StatRow(actor, start, n, n, 0, 0, n / 60, 5.0, 9.0, 20.0, 40.0)

    stats = [row("busy", 0, 120), row("busy", 2, 60), row("rare", 1, 1)]
    end = t0 + dt.timedelta(minutes=2, seconds=30)

    # When they are laid out with room for one actor
    page = charts.actor_charts(stats, t0, end, dt.timedelta(minutes=1), "1 min", max_actors=1)

    # Then the busiest actor is drawn: its throughput one unbroken line through 0, its
    # latency broken at the empty minute; the other is named as not drawn
    (throughput,) = page.throughput.lines
    assert throughput.label == "busy" and len(throughput.segments) == 1
    assert len(throughput.segments[0].split()) == 3
    (latency,) = page.latency
    assert all(len(line.dots) == 2 and not line.segments for line in latency.lines)
    assert page.totals == {"busy": (180, 0)} and page.hidden == ["rare"]


def test_a_request_for_another_host_name_is_refused_so_dns_rebinding_reads_nothing(
    db: Any, serve_dashboard: Serve
) -> None:
    # Given a dashboard without auth on 127.0.0.1 (the default)
    server = serve_dashboard()
    port = server.url.rsplit(":", 1)[1]
    with httpx.Client(base_url=server.url) as browser:
        # When a page of evil.example, rebound to 127.0.0.1, asks for it (its Host header stays)
        rebound = browser.get("/failed", headers={"Host": f"evil.example:{port}"})
        posted = browser.post("/failed/retry", data={"all": "1"}, headers={"Host": "evil.example"})
        # Then nothing is served and no session is started
        assert (rebound.status_code, posted.status_code) == (400, 400)
        assert "set-cookie" not in rebound.headers
        # And the loopback names still work
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
            assert browser.get("/failed", headers={"Host": host}).status_code == 200, host


def test_the_operator_names_the_hosts_of_a_dashboard_on_every_interface(
    database_url: str, db: Any, serve_dashboard: Serve
) -> None:
    from dramatiq_pg_outbox.cli.dashboard import allowed_host_names

    allowed = allowed_host_names("0.0.0.0", ["Dashboard.Example.com", "*.ops.example.com"])
    assert "dashboard.example.com" in allowed and "127.0.0.1" in allowed and "0.0.0.0" not in allowed
    assert "10.0.0.5" in allowed_host_names("10.0.0.5", [])
    server = serve_dashboard(allowed_hosts=allowed)
    with httpx.Client(base_url=server.url) as browser:
        assert browser.get("/", headers={"Host": "dashboard.example.com"}).status_code == 200
        assert browser.get("/", headers={"Host": "q.ops.example.com"}).status_code == 200
        assert browser.get("/", headers={"Host": "evil.example"}).status_code == 400


def test_rotating_the_token_ends_the_sessions_logged_in_with_the_old_one(
    db: Any, serve_dashboard: Serve
) -> None:
    # Given a session logged in with the token "old" (a fixed session secret, as behind a
    # load balancer, so a restarted server still reads the cookie)
    secret = "fixed-session-secret"
    first = serve_dashboard(token="old", session_secret=secret)
    with httpx.Client(base_url=first.url) as browser:
        csrf = csrf_token(browser.get("/login").text)
        assert browser.post("/login", data={"token": "old", "csrf_token": csrf}).status_code == 303
        assert browser.get("/failed").status_code == 200
        cookies = dict(browser.cookies)
    first.stop()
    # When the token is rotated (it leaked) and the dashboard restarted with the same secret
    second = serve_dashboard(token="new", session_secret=secret)
    with httpx.Client(base_url=second.url, cookies=cookies) as browser:
        # Then the old session no longer opens any page
        assert browser.get("/failed").status_code == 401
        # And logging in with the new token works
        csrf = csrf_token(browser.get("/login").text)
        assert browser.post("/login", data={"token": "new", "csrf_token": csrf}).status_code == 303
        assert browser.get("/failed").status_code == 200


def test_a_retried_attempt_is_not_counted_as_completed(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given a message that fails once and succeeds on its retry: two history rows
    broker = make_broker()
    attempts: list[int] = []

    @dramatiq.actor(broker=broker, queue_name="retried", max_retries=3, min_backoff=10, max_backoff=20)
    def flaky() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")

    flaky.send()
    run_until_finished(broker, start_worker, db, 2)
    server = serve_dashboard()
    # When the queues page is read
    queues = httpx.get(server.url + "/").text
    row = re.search(r'<tr data-queue="retried">(.*?)</tr>', queues, re.S)
    assert row, queues
    cells = re.findall(r'<td class="num[^"]*">([^<]*)<', row.group(1))
    # Then one message completed in the last hour, not two, and none failed
    assert cells[4:6] == ["1", "0"], cells


def test_lists_show_priority_and_arguments_and_a_large_payload_page_stays_small(
    make_broker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given a message with a priority and arguments, and one of 5 MiB (the limit raised for it)
    broker = make_broker(max_message_bytes=None)

    @dramatiq.actor(broker=broker, queue_name="bills")
    def bill(customer: int, plan: str, *, note: str = "") -> None:
        pass

    bill.send_with_options(args=(4711, "gold"), kwargs={"note": "vip"}, broker_priority=7)
    big = "x" * (5 * 1024 * 1024)
    bill.send(1, big)
    small_id, big_id = [r[0] for r in db.execute("SELECT id FROM dramatiq.messages ORDER BY id")]
    server = serve_dashboard()
    with httpx.Client(base_url=server.url) as browser:
        # When the queue's page is opened
        page = browser.get("/queues/bills").text
        # Then each row shows its priority and a short preview of its arguments
        row = re.search(rf'/messages/{small_id}">.*?</tr>', page, re.S)
        assert row is not None
        assert "[4711,&#34;gold&#34;] {&#34;note&#34;:&#34;vip&#34;}" in row.group(0)
        assert re.search(r'<td class="num">7</td>', row.group(0))
        big_row = re.search(rf'/messages/{big_id}">.*?</tr>', page, re.S)
        assert big_row is not None and "\u2026" in big_row.group(0) and len(big_row.group(0)) < 2_000
        # And the big message's page shows its first 64 KiB and its size, with a raw download
        shown = browser.get(f"/messages/{big_id}")
        assert shown.status_code == 200 and len(shown.content) < 200_000
        assert f"The first 65,536 of {len(bill.message(1, big).encode()):,} bytes" in shown.text
        download = browser.get(f"/messages/{big_id}/payload")
        assert download.headers["content-disposition"] == f'attachment; filename="message-{big_id}.payload"'
        assert download.content == bytes(
            db.execute("SELECT payload FROM dramatiq.messages WHERE id = %s", (big_id,)).fetchone()[0]
        )
        # And a small message's page pretty-prints it whole
        assert "&#34;gold&#34;" in browser.get(f"/messages/{small_id}").text
        assert browser.get("/messages/999999999/payload").status_code == 404


def test_a_wrong_bearer_token_gets_a_plain_401_and_repeated_failures_wait(
    db: Any, serve_dashboard: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    server = serve_dashboard(token="s3cret-token")

    def get(token: str) -> httpx.Response:
        return httpx.get(server.url + "/failed", headers={"Authorization": f"Bearer {token}"})

    # A script's wrong token: a plain answer that says why, not the login page
    wrong = get("wrong")
    assert wrong.status_code == 401 and wrong.text == "401 Unauthorized: the Bearer token is wrong"
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    # Five failures in a row are free; the sixth attempt must wait (even with the right token)
    with caplog.at_level("WARNING", logger="dramatiq_pg_outbox.dashboard"):
        for _ in range(4):
            assert get("wrong").status_code == 401
    refused = get("s3cret-token")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "too many failed logins from this address" in refused.text
    failures = [r.getMessage() for r in caplog.records if "failed login" in r.getMessage()]
    assert failures and all("127.0.0.1" in m and "s3cret" not in m and "wrong Bearer" in m for m in failures)
    # Once the wait is over, the right token gets in and the count starts again
    wait_for(lambda: get("s3cret-token").status_code == 200, 5, "the end of the wait", 0.2)
    assert get("wrong").status_code == 401


def test_the_login_throttle_doubles_the_wait_after_five_failures_up_to_its_cap() -> None:
    from dramatiq_pg_outbox.dashboard.security import LoginThrottle

    now = [100.0]
    throttle = LoginThrottle(free=5, base=1.0, cap=8.0, clients=2, clock=lambda: now[0])
    for _ in range(5):
        assert throttle.wait("a") == 0
        throttle.failed("a", "wrong token")
    waits = []
    for _ in range(5):
        waits.append(throttle.wait("a"))
        now[0] += throttle.wait("a")
        throttle.failed("a", "wrong token")
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0]
    # Another address is not affected; a success forgets; the oldest address is forgotten first
    assert throttle.wait("b") == 0
    throttle.succeeded("a")
    assert throttle.wait("a") == 0
    for client in ("c", "d", "e"):
        throttle.failed(client, "x")
    assert len(throttle) == 2  # (the bound on memory)


def test_an_action_is_audited_with_the_basic_auth_user_and_the_address(
    make_broker: Any, db: Any, serve_dashboard: Serve
) -> None:
    broker = make_broker()
    _, ship = failing_actors(broker)
    ship.send(1)
    server = serve_dashboard(basic_auth=("ops", "pa:ss"))
    auth = {"Authorization": "Basic " + base64.b64encode(b"ops:pa:ss").decode()}
    with httpx.Client(base_url=server.url, headers=auth) as browser:
        token = csrf_token(browser.get("/queues/shipping").text)
        browser.post("/queues/shipping/pause", data={"csrf_token": token})
        browser.post("/queues/shipping/pause", data={"csrf_token": token})
        page = browser.get("/audit").text
        browser.post("/queues/shipping/resume", data={"csrf_token": token})  # (pauses outlive a test)
    rows = db.execute(
        "SELECT operator, source, action, target, count, detail FROM dramatiq.audit "
        "WHERE target = 'shipping' AND operator = 'ops' AND action = 'pause' ORDER BY id"
    ).fetchall()
    # (the second click changed nothing: recorded with 0 rows)
    assert rows == [
        ("ops", "dashboard", "pause", "shipping", 1, "from 127.0.0.1"),
        ("ops", "dashboard", "pause", "shipping", 0, "from 127.0.0.1"),
    ]
    assert page.count('<td class="action">pause</td>') >= 2


def users_file(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "users"
    path.write_text("# name:role:kind:sha256:hex\n\n" + "".join(line + "\n" for line in lines))
    return str(path)


def test_named_users_act_by_their_role_and_the_audit_names_them(
    make_broker: Any, db: Any, serve_dashboard: Serve, tmp_path: Path
) -> None:
    # Given a dashboard with an operator (a token) and a read-only user (basic auth)
    make_broker()
    queue = f"roles_{os.getpid()}_{free_port()}"
    path = users_file(
        tmp_path,
        f"alice:operator:token:sha256:{secret_digest('alice-token')}",
        f"grafana:read-only:basic:sha256:{secret_digest('pa:ss')}",
    )
    server = serve_dashboard(users=load_users(path))
    viewer = {"Authorization": "Basic " + base64.b64encode(b"grafana:pa:ss").decode()}
    operator = {"Authorization": "Bearer alice-token"}
    try:
        with httpx.Client(base_url=server.url, headers=viewer) as browser:
            # When the read-only user opens a queue and posts its pause anyway
            page = browser.get(f"/queues/{queue}")
            refused = browser.post(f"/queues/{queue}/pause", data={"csrf_token": csrf_token(page.text)})
        with httpx.Client(base_url=server.url, headers=operator) as browser:
            mine = browser.get(f"/queues/{queue}")
            paused = browser.post(f"/queues/{queue}/pause", data={"csrf_token": csrf_token(mine.text)})
        with httpx.Client(base_url=server.url, follow_redirects=True) as browser:
            # (the login form knows alice's token, not the basic-auth user's password)
            login = browser.get("/login")
            wrong = browser.post("/login", data={"csrf_token": csrf_token(login.text), "token": "pa:ss"})
            right = browser.post(
                "/login", data={"csrf_token": csrf_token(wrong.text), "token": "alice-token", "next": "/"}
            )
    finally:
        db.execute("DELETE FROM dramatiq.queue_pauses WHERE queue_name = %s", (queue,))
    # Then the read-only user sees no action button and is refused; the operator acts
    assert page.status_code == 200 and 'id="user">grafana<' in page.text
    assert 'id="pause"' not in page.text
    assert refused.status_code == 403 and "grafana is read-only" in refused.text
    assert mine.status_code == 200 and 'id="pause"' in mine.text
    assert paused.status_code == 303
    assert wrong.status_code == 401 and right.status_code == 200 and 'id="user">alice<' in right.text
    # And the audit trail names the operator, and only the action that happened
    rows = db.execute(
        "SELECT operator, action, count FROM dramatiq.audit WHERE target = %s ORDER BY id", (queue,)
    ).fetchall()
    assert rows == [("alice", "pause", 1)]


def test_a_read_only_token_user_gets_no_retry_form_and_403(
    serve_dashboard: Serve, tmp_path: Path, make_broker: Any
) -> None:
    make_broker()
    path = users_file(tmp_path, f"viewer:read-only:token:sha256:{secret_digest('v-token')}")
    server = serve_dashboard(users=load_users(path))
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer v-token"}) as browser:
        failed = browser.get("/failed")
        retry = browser.post("/failed/retry", data={"all": "1", "csrf_token": csrf_token(failed.text)})
    assert failed.status_code == 200 and 'id="retry-form"' not in failed.text and "read-only" in failed.text
    assert retry.status_code == 403


def test_the_dashboard_and_the_command_line_print_a_dead_letter_alike_its_type_once(
    make_broker: Any, db: Any, serve_dashboard: Serve, capsys: pytest.CaptureFixture[str], database_url: str
) -> None:
    # Given a dead letter whose error text starts with its type
    make_broker()
    queue = f"alike_{os.getpid()}_{free_port()}"
    row_id, finished = db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, "
        "enqueued_at, finished_at, error_type, error, payload) "
        "VALUES ((1e9 + floor(random() * 1e9))::bigint, %s, 'charge', gen_random_uuid()::text, "
        "'failed', 1, now(), now() - interval '200 seconds', 'ValueError', 'ValueError: bad input', '') "
        "RETURNING id, finished_at",
        (queue,),
    ).fetchone()
    try:
        # When the failed page and `dramatiq-pg-outbox failed` show it
        server = serve_dashboard()
        page = httpx.get(f"{server.url}/failed?queue={queue}").text
        assert main(["failed", "--queue", queue, "--url", database_url]) == 0
        table = capsys.readouterr().out
    finally:
        db.execute("DELETE FROM dramatiq.history WHERE id = %s", (row_id,))
    # Then both print the time the same way, and the type once
    shown = format_time(finished)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", shown)
    cell = re.search(r'<td class="error-line">(.*?)</td>', page, re.S)
    assert cell is not None and cell.group(1).strip() == "<strong>ValueError</strong>: bad input"
    assert f"<td>{shown}</td>" in page
    line = next(line for line in table.splitlines() if line.startswith(str(row_id)))
    assert shown in line and line.endswith("ValueError: bad input") and line.count("ValueError") == 1


def test_ages_read_the_same_on_the_pages_and_in_the_tables() -> None:
    from dramatiq_pg_outbox.dashboard.app import _templates

    age = _templates().env.filters["age"]
    for seconds, text in [
        (0.42, "0.4 s"),
        (42, "42 s"),
        (200, "3 min 20 s"),
        (7500, "2 h 05 min"),
        (273600, "3 d 04 h"),
    ]:
        assert age(seconds) == format_age(seconds) == text
    assert error_parts("ValueError", "ValueError: bad") == ("ValueError", ": bad")
    assert error_parts("CardDeclined", "Traceback (most recent call last):\n  ...\napp.CardDeclined: no") == (
        "CardDeclined",
        ": no",
    )
    assert error_parts("DecodeError", "ValueError: bad json") == ("DecodeError", ": ValueError: bad json")


def test_a_schedules_run_now_button_makes_its_next_tick_due_and_is_audited(
    db: Any, serve_dashboard: Serve
) -> None:
    # Given a schedule due in an hour and a disabled one
    name, off = f"report-{os.getpid()}", f"off-{os.getpid()}"
    db.execute(
        "INSERT INTO dramatiq.schedules (name, actor_name, queue_name, every_ms, next_run_at, disabled_at) "
        "VALUES (%s, 'report', 'default', 3600000, now() + interval '1 hour', NULL), "
        "(%s, 'report', 'default', 3600000, now() + interval '1 hour', now())",
        (name, off),
    )
    try:
        server = serve_dashboard()
        with httpx.Client(base_url=server.url) as browser:
            page = browser.get("/schedules").text
            row = re.search(rf"<td>{name}</td>.*?</tr>", page, re.S)
            off_row = re.search(rf"<td>{off}</td>.*?</tr>", page, re.S)
            assert row and "Run now" in row.group(0), page
            assert off_row and "Run now" not in off_row.group(0)
            # When the operator clicks it
            done = browser.post("/schedules/run-now", data={"csrf_token": csrf_token(page), "name": name})
            assert done.status_code == 303
            flashed = browser.get("/schedules").text
        # Then its next tick is due now, on record with who and how many rows
        assert "is due now" in flashed
        assert (
            count(
                db, f"SELECT count(*) FROM dramatiq.schedules WHERE name = '{name}' AND next_run_at <= now()"
            )
            == 1
        )
        assert db.execute(
            "SELECT source, action, target, count FROM dramatiq.audit WHERE target = %s", (name,)
        ).fetchall() == [("dashboard", "schedule-run-now", name, 1)]
    finally:
        db.execute("DELETE FROM dramatiq.schedules WHERE name IN (%s, %s)", (name, off))


def test_the_limits_page_lists_keys_and_sets_and_removes_a_run_time_limit(
    make_broker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given keyed messages waiting: three of customer:1 (carrying limit 2), one of customer:2
    broker = make_broker()
    _, ship = failing_actors(broker)
    db.execute("DELETE FROM dramatiq.concurrency_limits")
    for order in range(3):
        ship.send_with_options(args=(order,), concurrency_key="customer:1", concurrency_limit=2)
    ship.send_with_options(args=(9,), concurrency_key="customer:2")
    server = serve_dashboard()
    try:
        with httpx.Client(base_url=server.url) as browser:
            page = browser.get("/limits").text
            # Then the page lists the keys with the limit each takes from its messages
            assert 'id="no-limits"' in page
            keys = re.findall(r'<tr data-key="([^"]+)" data-queue="([^"]+)">', page)
            assert keys == [("customer:1", "shipping"), ("customer:2", "shipping")]
            # When an operator sets a run-time limit for the prefix
            token = csrf_token(page)
            done = browser.post(
                "/limits", data={"csrf_token": token, "prefix": "customer:", "max_running": "5"}
            )
            shown = browser.get(done.headers["location"]).text
            assert "Keys customer:* may now have 5 message(s) processing at a time (was: none)" in shown
            assert '<tr data-prefix="customer:" data-queue="">' in shown
            assert db.execute("SELECT prefix, max_running FROM dramatiq.concurrency_limits").fetchall() == [
                ("customer:", 5)
            ]
            # And a limit of one queue: it is listed with its queue, and the keys of that queue take it
            done = browser.post(
                "/limits",
                data={"csrf_token": token, "prefix": "customer:1", "queue": "shipping", "max_running": "1"},
            )
            shown = browser.get(done.headers["location"]).text
            assert "Keys customer:1* of queue shipping may now have 1 message(s) processing" in shown
            assert '<tr data-prefix="customer:1" data-queue="shipping">' in shown
            assert re.search(r'data-key="customer:1".*?<code>customer:1</code>\* of shipping', shown, re.S)
            assert browser.post(
                "/limits", data={"csrf_token": token, "prefix": "x:", "queue": "no such!", "max_running": "1"}
            ).status_code == 400  # fmt: skip
            done = browser.post(
                "/limits",
                data={"csrf_token": token, "prefix": "customer:1", "queue": "shipping", "max_running": ""},
            )
            assert (
                "Removed the limit 1 of keys customer:1* of queue shipping"
                in browser.get(done.headers["location"]).text
            )
            # And a bad limit is refused, changing nothing
            assert (
                browser.post(
                    "/limits", data={"csrf_token": token, "prefix": "customer:", "max_running": "-1"}
                ).status_code
                == 400
            )
            # And removing it (an empty limit) says so and is audited with the setting
            done = browser.post(
                "/limits", data={"csrf_token": token, "prefix": "customer:", "max_running": ""}
            )
            assert "Removed the limit 5 of keys customer:*" in browser.get(done.headers["location"]).text
    finally:
        db.execute("DELETE FROM dramatiq.concurrency_limits")
    rows = db.execute(
        "SELECT action, target, count FROM dramatiq.audit WHERE target = 'customer:' ORDER BY id"
    ).fetchall()
    assert rows[-2:] == [("limit-set", "customer:", 5), ("limit-unset", "customer:", 5)]
