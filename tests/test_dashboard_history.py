"""Finished work on the dashboard: a finished message's page and the history search (issue 33, part 1).

A real uvicorn server on a real PostgreSQL; the message page is checked on rows
that real Dramatiq workers finished (retries, a result, a pipeline), the search
on history rows written with payloads of Dramatiq's JSONEncoder.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import dramatiq
import pytest
from dramatiq.results import Results

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.dashboard.store import args_needle, parse_time
from dramatiq_pg_outbox.results import PostgresBackend
from tests.dashboard_support import DashboardServer, serve_dashboard
from tests.helpers import count, wait_for

httpx = pytest.importorskip("httpx", reason="httpx is not installed: pip install -e '.[dev]'")

__all__ = ["serve_dashboard"]  # the fixture, imported for pytest

Serve = Callable[..., DashboardServer]


class GatewayDown(Exception):
    pass


def test_a_finished_message_page_shows_each_delivery_its_errors_its_result_and_its_next_step(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Serve
) -> None:
    # Given a charge that failed twice before it succeeded and stored its result, then a receipt step
    db.execute("TRUNCATE dramatiq.results")
    broker: PostgresBroker = make_broker()
    backend = PostgresBackend(broker=broker, cleanup_interval=None)
    broker.add_middleware(Results(backend=backend))
    calls = {"n": 0}

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=10, max_backoff=20, store_results=True)
    def charge(customer: str, cents: int) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] < 3:
            raise GatewayDown(f"gateway down for {customer}, call {calls['n']}")
        return {"charged": cents, "customer": customer}

    @dramatiq.actor(broker=broker)
    def receipt(charged: dict[str, Any]) -> None:
        pass

    try:
        pipe = dramatiq.pipeline([charge.message("cust-7781", 1999), receipt.message()], broker=broker)
        pipe.run()
        start_worker(broker)
        wait_for(
            lambda: count(db, "SELECT count(*) FROM dramatiq.history") == 4, 30, "3 charges and a receipt"
        )
        rows = db.execute(
            "SELECT id, actor_name, error_type, message_id FROM dramatiq.history ORDER BY finished_at, id"
        ).fetchall()
        charges = [r for r in rows if r[1] == "charge"]
        (receipt_row,) = [r for r in rows if r[1] == "receipt"]
        assert [r[2] for r in charges] == ["GatewayDown", "GatewayDown", None]
        server = serve_dashboard()

        # When the operator opens the last charge (the one that completed)
        page = httpx.get(f"{server.url}/messages/{charges[-1][0]}")

        # Then it answers for a finished message with all three deliveries, oldest first, linked
        assert page.status_code == 200, page.text
        html = page.text
        table = re.search(r'<table class="grid" id="delivery-list">(.*?)</table>', html, re.S)
        assert table, html
        assert re.findall(r'data-outcome="(\w+)"', table.group(1)) == ["retried", "retried", "completed"]
        for row_id, *_ in charges[:2]:
            assert f'/messages/{row_id}">' in table.group(1)
        assert "GatewayDown: gateway down for cust-7781, call 1" in table.group(1)
        assert "GatewayDown: gateway down for cust-7781, call 2" in table.group(1)
        # its stored result
        result = re.search(r'<pre class="result" id="result">(.*?)</pre>', html, re.S)
        assert result and "&#34;charged&#34;: 1999" in result.group(1), html
        # and its next step, whose link leads to the receipt's row
        link = re.search(r'<dd>receipt <a href="([^"]+)">', html)
        assert link, html
        found = httpx.get(link.group(1).replace("&amp;", "&"))
        assert found.status_code == 303 and found.headers["location"].endswith(f"/messages/{receipt_row[0]}")
        # A retried delivery's page names the error and shows its traceback
        first = httpx.get(f"{server.url}/messages/{charges[0][0]}").text
        assert "retried (its actor raised" in first and "Traceback (most recent call last):" in first
        # An unknown id answers 404 in one line; so does a message id that no row has
        missing = httpx.get(f"{server.url}/messages/987654321")
        assert missing.status_code == 404 and "nor in history" in missing.text
        assert httpx.get(f"{server.url}/messages/find?message_id=nope").status_code == 404
    finally:
        backend.close()


def _payload(actor: str, args: list[Any], kwargs: dict[str, Any] | None = None, **options: Any) -> bytes:
    """A payload as Dramatiq's JSONEncoder writes it (``Message.asdict()`` order, compact separators)."""
    message = dramatiq.Message(
        queue_name="default", actor_name=actor, args=tuple(args), kwargs=kwargs or {}, options=options
    )
    return dramatiq.get_encoder().encode(message.asdict())


def _archive(
    db: Any, row_id: int, actor: str, payload: bytes, finished: dt.datetime, state: str = "completed",
    queue: str = "default", message_id: str | None = None,
) -> None:  # fmt: skip
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at,"
        " started_at, finished_at, error_type, error, payload)"
        " VALUES (%s, %s, %s, %s, %s, 1, %s, %s, %s, %s, %s, %s)",
        (row_id, queue, actor, message_id or str(uuid.uuid4()), state, finished, finished, finished,
         "Boom" if state == "failed" else None, "Boom: no" if state == "failed" else None, payload),
    )  # fmt: skip


def _ids(html: str) -> list[int]:
    table = re.search(r'<table class="grid" id="history">(.*?)</table>', html, re.S)
    return [int(i) for i in re.findall(r'<a href="[^"]*/messages/(\d+)">', table.group(1))] if table else []


def test_history_lists_finished_messages_newest_first_and_finds_them_by_their_arguments(
    db: Any, serve_dashboard: Serve
) -> None:
    # Given finished messages over three days, of two actors, one with a customer id in its
    # arguments, one with it only in its next pipeline step's, one in a pickle-like payload
    now = db.execute("SELECT now()").fetchone()[0]
    db.execute("SELECT dramatiq.create_history_partitions(0, (now() - interval '3 days')::date)")
    db.execute("SELECT dramatiq.create_history_partitions(0, (now() - interval '2 days')::date)")
    ticket = "cust-4242"
    _archive(db, 1, "charge", _payload("charge", [ticket, 100]), now - dt.timedelta(days=2))
    _archive(db, 2, "charge", _payload("charge", ["cust-1", 5]), now - dt.timedelta(hours=3))
    _archive(db, 3, "refund", _payload("refund", [], {"customer": ticket}), now - dt.timedelta(hours=2),
             state="failed")  # fmt: skip
    nested = {"pipe_target": json.loads(_payload("refund", [ticket]))}
    _archive(db, 4, "charge", _payload("charge", ["cust-2", 7], **nested), now - dt.timedelta(hours=1))
    _archive(db, 5, "charge", b"\x80\x04\x95 pickled cust-4242 \x00\xff", now - dt.timedelta(minutes=30))
    _archive(db, 6, "charge", _payload("charge", [f"x{ticket}y"]), now - dt.timedelta(minutes=20))
    _archive(db, 7, "refund", _payload("refund", ["café", 1]), now - dt.timedelta(minutes=10))
    for i in range(8, 8 + 55):  # more than a page, the newest
        _archive(
            db, i, "ping", _payload("ping", [i]), now - dt.timedelta(seconds=100 - i), message_id=f"m-{i}"
        )
    server = serve_dashboard()

    def search(**params: str) -> list[int]:
        page = httpx.get(server.url + "/history", params=params)
        assert page.status_code == 200, page.text
        return _ids(page.text)

    # Then the last 24 hours, newest first, by pages of 50 (keyset: "older" continues)
    first = httpx.get(server.url + "/history").text
    assert _ids(first) == list(range(62, 12, -1))
    older = re.search(r'<a href="\?([^"]+)" id="older">', first)
    assert older, first
    assert _ids(httpx.get(server.url + "/history?" + older.group(1).replace("&amp;", "&")).text) == [
        12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
    ]  # fmt: skip
    # the arguments, in args or kwargs, over 3 days: not the next step's, not the opaque payload
    assert search(args=ticket, since="3d") == [6, 3, 1]
    assert search(args=f'"{ticket}"', since="3d") == [3, 1]  # a whole string value
    assert search(args=ticket) == [6, 3]  # the default range: 24 h
    assert search(args=ticket, since="3d", actor="charge") == [6, 1]
    assert search(args=ticket, since="3d", state="failed") == [3]
    assert search(args="café") == [7]  # escaped as the encoder escapes it
    assert search(message_id="m-9") == [9]
    assert search(since="3d", until="2h") == [3, 2, 1]
    # A bad time is one line on the page, not an error
    bad = httpx.get(server.url + "/history", params={"since": "yesterday"})
    assert bad.status_code == 200 and "is not a time: give 2026-11-27T10:00 (UTC) or an age" in bad.text
    # The finished page of a message found there
    letter = httpx.get(f"{server.url}/messages/3").text
    assert "<strong>failed</strong> (a dead letter)" in letter and "Boom" in letter
    assert httpx.get(f"{server.url}/failed/3").status_code == 200
    assert httpx.get(f"{server.url}/failed/2").status_code == 404  # completed: not a dead letter


def test_a_large_finished_payload_page_stays_small_and_downloads_whole(
    db: Any, serve_dashboard: Serve
) -> None:
    now = db.execute("SELECT now()").fetchone()[0]
    big = _payload("render", ["x" * (5 << 20)])
    _archive(db, 77, "render", big, now)
    server = serve_dashboard()
    page = httpx.get(f"{server.url}/messages/77")
    assert page.status_code == 200 and len(page.content) < 200_000, len(page.content)
    assert f"{len(big):,} bytes" in page.text
    download = httpx.get(f"{server.url}/messages/77/payload")
    assert download.content == big


def test_history_search_terms_and_times() -> None:
    assert args_needle("cust-42") == b"cust-42"
    assert args_needle('"cust-42"') == b'"cust-42"'
    assert args_needle("café") == b"caf\\u00e9"
    assert args_needle('say "hi"') == b'say \\"hi\\"'
    now = dt.datetime(2026, 11, 27, 12, tzinfo=dt.timezone.utc)
    assert parse_time("6h", now) == now - dt.timedelta(hours=6)
    assert parse_time("2026-11-27T10:00", now) == dt.datetime(2026, 11, 27, 10, tzinfo=dt.timezone.utc)
    with pytest.raises(ValueError, match="is not a time"):
        parse_time("soon", now)


def test_the_history_command_runs_the_pages_search_as_a_table_or_json(database_url: str, db: Any) -> None:
    from tests.test_cli import cli

    # Given three finished messages, two of them for the ticket's customer
    now = db.execute("SELECT now()").fetchone()[0]
    _archive(db, 21, "charge", _payload("charge", ["cust-9001", 5]), now - dt.timedelta(hours=2))
    _archive(db, 22, "charge", _payload("charge", ["cust-1", 5]), now - dt.timedelta(hours=1))
    _archive(
        db, 23, "refund", _payload("refund", ["cust-9001"]), now - dt.timedelta(minutes=5), state="failed"
    )

    # When the command searches by argument, as JSON and as a table
    found = cli("history", "--url", database_url, "--args", "cust-9001", "--json")
    table = cli("history", "--url", database_url, "--actor", "refund")
    bad = cli("history", "--url", database_url, "--since", "last tuesday")

    # Then it finds what the History page finds, newest first
    assert found.returncode == 0, found.stderr
    rows = json.loads(found.stdout)
    assert [(r["id"], r["outcome"], r["args"]) for r in rows] == [
        (23, "failed", '["cust-9001"]'),
        (21, "completed", '["cust-9001",5]'),
    ]
    assert rows[0]["error"] == "Boom: no"
    assert table.returncode == 0 and "refund" in table.stdout and "charge" not in table.stdout
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not a time" in bad.stderr, bad.stderr
