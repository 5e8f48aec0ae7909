"""Canceling a running message (issue 35, part 3): the CLI's ``cancel`` and the dashboard's Cancel.

Real workers (a ``dramatiq`` CLI process running tests/worker_app.py, or Dramatiq's
``Worker`` in this process) run actors that loop in Python; the operator's cancel marks
the row and notifies the broker channel, the worker interrupts the actor (or, for
``cancel="ask"``, the actor asks ``is_canceled()``), and the message ends in history as
``canceled``, with no retry and none of its follow-ups.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import dramatiq
import httpx
import pytest

from dramatiq_pg_outbox import Canceled, is_canceled
from dramatiq_pg_outbox.dashboard.store import Store
from tests.dashboard_support import DashboardServer, csrf_token, serve_dashboard
from tests.helpers import wait_for
from tests.test_cli import cli, one_line_error
from tests.test_cli_operator import run

__all__ = ["serve_dashboard"]  # the fixture, imported for pytest


def started(db: Any, key: str) -> int:
    return int(db.execute("SELECT count(*) FROM started WHERE key = %s", (key,)).fetchone()[0])


def received(db: Any) -> list[str]:
    return [key for (key,) in db.execute("SELECT key FROM received ORDER BY key")]


def finished_state(db: Any, row_id: int) -> str | None:
    row = db.execute("SELECT state FROM dramatiq.history WHERE id = %s", (row_id,)).fetchone()
    return None if row is None else str(row[0])


def the_row(db: Any, actor_name: str) -> int:
    query = "SELECT id FROM dramatiq.messages WHERE actor_name = %s"
    ((row_id,),) = db.execute(query, (actor_name,)).fetchall()
    return int(row_id)


def test_the_cli_cancel_interrupts_an_actor_running_in_a_dramatiq_worker_process(
    worker_process: Any, producer: Any, db: Any, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a `dramatiq` worker process running an actor that loops in Python (retries left), the
    # first step of a pipeline, with callbacks on success and on failure; its poll for cancels
    # (each heartbeat) is 5 s apart, so only the notification can stop it within 2 s
    worker_process(threads=2, env={"DPO_HEARTBEAT_INTERVAL": "5000", "DPO_HEARTBEAT_TIMEOUT": "20000"})
    step = producer.spin.message_with_options(
        args=("long", 60), on_success=producer.note, on_failure=producer.note
    )
    (step | producer.record.message("next")).run()
    wait_for(lambda: started(db, "long") == 1, 30, "the actor to start")
    row_id = the_row(db, "spin")

    # When an operator cancels it with the CLI
    asked = time.monotonic()
    out = run(capsys, "cancel", str(row_id), "--url", database_url)
    assert out.startswith(f"canceling message {row_id} of queue 'default': its worker (")

    # Then the actor stops within 2 s and the message is in history as canceled, where it was stopped
    wait_for(lambda: finished_state(db, row_id) == "canceled", 5, "the message to be canceled")
    assert time.monotonic() - asked < 2.5
    ((error_type, error),) = db.execute(
        "SELECT error_type, error FROM dramatiq.history WHERE id = %s", (row_id,)
    ).fetchall()
    assert error_type == "Canceled"
    assert "in spin" in error and "Canceled" in error and "with dramatiq-pg-outbox cancel" in error
    # And nothing follows it: no retry, no next step of the pipeline, no callback
    time.sleep(0.5)
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone() == (0,)
    assert received(db) == []
    assert started(db, "long") == 1
    # And a second cancel says that it finished, exit 1
    one_line_error(
        cli("cancel", str(row_id), "--url", database_url),
        1,
        says=[f"message {row_id} already finished (canceled) at"],
    )


def test_a_running_message_whose_worker_was_killed_is_canceled_by_the_rescuer(
    worker_process: Any, producer: Any, db: Any, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a message whose worker process was killed -9 while it ran
    first = worker_process(threads=1)
    producer.spin.send("orphan", 60)
    wait_for(lambda: started(db, "orphan") == 1, 30, "the actor to start")
    row_id = the_row(db, "spin")
    first.stop(9)

    # When an operator cancels it, and a worker process starts (its rescuer runs)
    out = run(capsys, "cancel", str(row_id), "--url", database_url)
    assert out.startswith(f"canceling message {row_id}")
    worker_process(threads=1)

    # Then it ends in history as canceled, and never runs again
    wait_for(lambda: finished_state(db, row_id) == "canceled", 30, "the rescuer to cancel it")
    ((error,),) = db.execute("SELECT error FROM dramatiq.history WHERE id = %s", (row_id,)).fetchall()
    assert "archived by the rescuer" in error and "with dramatiq-pg-outbox cancel" in error
    time.sleep(0.5)
    assert started(db, "orphan") == 1
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone() == (0,)


def test_the_dashboard_store_cancels_an_interrupted_actor_with_no_retry_and_no_callback(
    make_broker: Any, start_worker: Any, db: Any, database_url: str
) -> None:
    # Given an actor that loops in Python (retries left, a callback on failure) running in a worker
    broker = make_broker()
    stopped: list[BaseException] = []
    calls: list[str] = []

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=10)
    def loop() -> None:
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                sum(range(1_000))
        except BaseException as e:
            stopped.append(e)
            raise

    @dramatiq.actor(broker=broker, max_retries=0)
    def on_failure(*args: Any) -> None:
        calls.append("on_failure")

    loop.send_with_options(on_failure=on_failure)
    start_worker(broker)
    row_id = the_row(db, "loop")
    wait_for(lambda: row_id in broker.runtime.running_ids(), 10, "the actor to start")

    # When the dashboard's store cancels it
    async def cancel() -> Any:
        store = Store(database_url, "dramatiq", broker.channel)
        await store.open()
        try:
            return await store.cancel_message(row_id, "by the test")
        finally:
            await store.close()

    result = asyncio.run(cancel())
    assert (result.outcome, result.queue_name) == ("canceling", "default")

    # Then the actor's thread got Canceled, and the message is canceled in history with the reason
    wait_for(lambda: finished_state(db, row_id) == "canceled", 5, "the message to be canceled")
    assert [type(e) for e in stopped] == [Canceled]
    ((error,),) = db.execute("SELECT error FROM dramatiq.history WHERE id = %s", (row_id,)).fetchall()
    assert error.rstrip().endswith("by the test")
    # And neither the retry nor the callback was enqueued; it counts as canceled, not as a dead letter
    time.sleep(0.3)
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone() == (0,)
    assert calls == []
    assert db.execute("SELECT count(*) FROM dramatiq.dead_letter_counts").fetchone() == (0,)
    assert db.execute("SELECT state, sum(n) FROM dramatiq.finished_counts GROUP BY 1").fetchall() == [
        ("canceled", 1)
    ]


def test_an_actor_that_asks_sees_is_canceled_and_returns_without_listen(
    make_broker: Any, start_worker: Any, db: Any, serve_dashboard: Any
) -> None:
    # Given an actor declared cancel="ask" on a worker that does not LISTEN (the poll's fallback)
    broker = make_broker(listen=False)
    told = threading.Event()
    interrupted: list[BaseException] = []

    @dramatiq.actor(broker=broker, cancel="ask", max_retries=3, min_backoff=10)
    def careful() -> None:
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                if is_canceled():
                    told.set()
                    return
                sum(range(1_000))
        except BaseException as e:  # never: it is not interrupted
            interrupted.append(e)
            raise

    careful.send()
    start_worker(broker)
    row_id = the_row(db, "careful")
    wait_for(lambda: row_id in broker.runtime.running_ids(), 10, "the actor to start")
    assert not is_canceled()  # outside an actor

    # When it is canceled from the dashboard
    server: DashboardServer = serve_dashboard()
    with httpx.Client(base_url=server.url) as browser:
        token = csrf_token(browser.get(f"/messages/{row_id}").text)
        told_page = browser.post(f"/messages/{row_id}/cancel", data={"csrf_token": token})
        assert "Canceling message" in browser.get(told_page.headers["location"]).text

    # Then the actor learns it within a heartbeat or two and returns; it ends canceled, not retried
    assert told.wait(3)
    wait_for(lambda: finished_state(db, row_id) == "canceled", 5, "the message to be canceled")
    assert interrupted == []
    time.sleep(0.3)
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone() == (0,)


def test_an_actor_declared_with_an_unknown_cancel_mode_is_refused(make_broker: Any) -> None:
    broker = make_broker()
    with pytest.raises(ValueError, match=r"cancel='later' is not an option; use cancel=\"interrupt\""):

        @dramatiq.actor(broker=broker, cancel="later")
        def undecided() -> None:
            pass


def test_a_prefetched_message_canceled_before_it_starts_never_runs_and_the_next_one_does(
    make_broker: Any, start_worker: Any, db: Any, database_url: str
) -> None:
    # Given a worker of one thread busy with a first message, and a second one claimed and
    # waiting in its buffer (prefetched: processing in the table, not running)
    broker = make_broker()
    release = threading.Event()
    ran: list[str] = []

    @dramatiq.actor(broker=broker, max_retries=3)
    def job(name: str) -> None:
        ran.append(name)
        if name == "busy":
            release.wait(20)

    job.send("busy")
    job.send("prefetched")
    job.send("after")
    start_worker(broker, worker_threads=1)
    wait_for(lambda: ran == ["busy"], 30, "the first message to start")
    second = int(
        db.execute(
            "SELECT min(id) FROM dramatiq.messages WHERE id > (SELECT min(id) FROM dramatiq.messages)"
        ).fetchone()[0]
    )
    wait_for(
        lambda: (
            db.execute("SELECT state FROM dramatiq.messages WHERE id = %s", (second,)).fetchone()
            == ("processing",)
        ),
        30,
        "the second message to be prefetched",
    )
    assert second not in broker.runtime.running_ids()

    # When the operator cancels the prefetched one, then the first ends
    async def cancel() -> Any:
        store = Store(database_url, "dramatiq", broker.channel)
        await store.open()
        try:
            return await store.cancel_message(second, "not needed any more")
        finally:
            await store.close()

    assert asyncio.run(cancel()).outcome == "canceling"
    # (the notification reaches the worker's listener thread; a cancel that reaches it after
    # the actor started is a running cancel, and one after it returned is too late, as the
    # guarantees say: the first message ends only once the worker holds the cancel)
    wait_for(lambda: second in broker.runtime.cancel_before_start, 30, "the worker to hold the cancel")
    release.set()
    # Then it never runs, ends canceled, and the next message runs
    wait_for(lambda: ran == ["busy", "after"], 30, "the third message to run")
    wait_for(lambda: finished_state(db, second) == "canceled", 30, "the prefetched message to be canceled")
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone() == (0,)
