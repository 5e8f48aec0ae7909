"""Pausing and resuming a queue: the CLI, the dashboard, a metric, real workers, the relay."""

from __future__ import annotations

import time
from typing import Any

import dramatiq
import httpx
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_pg_outbox.metrics import DatabaseCollector
from dramatiq_pg_outbox.relay import Relay
from tests.dashboard_support import DashboardServer, csrf_token, serve_dashboard
from tests.helpers import count, wait_for
from tests.test_cli import cli

__all__ = ["serve_dashboard"]  # the fixture, imported for pytest

#: Generous bound for things that take milliseconds, in seconds (a loaded 2-core machine).
SOON = 15
#: A poll far longer than the tests' waits: whatever is claimed sooner was woken by a NOTIFY.
SLOW_POLL = 30_000


@pytest.fixture
def no_pauses(db: Any) -> Any:
    db.execute("TRUNCATE dramatiq.queue_pauses")
    yield db
    db.execute("TRUNCATE dramatiq.queue_pauses")


def worker_of(make_broker: Any, start_worker: Any, done: list[int]) -> Any:
    broker = make_broker(max_fetch_interval=SLOW_POLL)

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(i: int) -> None:
        done.append(i)

    broker.declare_queue("work")
    start_worker(broker)
    return job


def pending(db: Any) -> int:
    return count(db, "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'work' AND state = 'pending'")


def test_a_paused_queue_keeps_its_messages_until_it_is_resumed(
    database_url: str, make_broker: Any, start_worker: Any, no_pauses: Any
) -> None:
    db = no_pauses
    # Given a running worker of queue "work" that has just run a message (it is listening)
    done: list[int] = []
    job = worker_of(make_broker, start_worker, done)
    job.send(0)
    wait_for(lambda: done == [0], SOON, "the first message")
    # When the queue is paused, and messages are sent (each send wakes the worker with a NOTIFY)
    result = cli("pause", "work", "--url", database_url)
    assert result.returncode == 0 and "paused queue 'work'" in result.stdout
    for i in range(1, 4):
        job.send(i)
    time.sleep(2.0)
    # Then they are stored and wait: the worker does not claim them
    assert done == [0] and pending(db) == 3
    status = cli("status", "--url", database_url)
    assert status.returncode == 0 and "paused: work (since " in status.stdout
    assert "already paused" in cli("pause", "work", "--url", database_url).stdout
    # When it is resumed
    resumed_at = time.monotonic()
    result = cli("resume", "work", "--url", database_url)
    assert result.returncode == 0 and "resumed queue 'work'" in result.stdout
    # Then the worker is woken at once (its poll is 30 s away) and runs them
    wait_for(lambda: sorted(done) == [0, 1, 2, 3], SOON, "the waiting messages")
    assert time.monotonic() - resumed_at < 10
    assert "paused" not in cli("status", "--url", database_url).stdout
    assert "was not paused" in cli("resume", "work", "--url", database_url).stdout


def test_the_pause_is_stored_so_a_restarted_worker_keeps_it(
    database_url: str, make_broker: Any, start_worker: Any, no_pauses: Any
) -> None:
    db = no_pauses
    # Given a paused queue with messages, and a worker started after the pause
    assert cli("pause", "work", "--create", "--url", database_url).returncode == 0
    done: list[int] = []
    job = worker_of(make_broker, start_worker, done)
    for i in range(3):
        job.send(i)
    job.send_with_options(args=(9,), delay=200)
    time.sleep(2.0)
    # Then nothing runs, delayed messages included (the delay queue is paused with it)
    assert done == [] and pending(db) == 4
    assert {r[0] for r in db.execute("SELECT queue_name FROM dramatiq.queue_pauses")} == {"work", "work.DQ"}
    # And the metric says so
    snapshot = DatabaseCollector(database_url).read()
    assert snapshot.paused == {"work"}  # (its delay queue folded into it)
    families = {f.name: f for f in DatabaseCollector(database_url).collect()}
    samples = {s.labels["queue_name"]: s.value for s in families["dramatiq_pg_outbox_queue_paused"].samples}
    assert samples["work"] == 1.0
    assert cli("resume", "work", "--url", database_url).returncode == 0
    wait_for(lambda: sorted(done) == [0, 1, 2, 9], SOON, "the messages after resume")
    samples = {
        s.labels["queue_name"]: s.value
        for s in {f.name: f for f in DatabaseCollector(database_url).collect()}[
            "dramatiq_pg_outbox_queue_paused"
        ].samples
    }
    assert samples.get("work", 0.0) == 0.0


def test_pause_refuses_a_delay_queue_and_a_bad_name(database_url: str, no_pauses: Any) -> None:
    for name, says in (("work.DQ", "is a delay queue: pause or resume 'work'"), ("no way!", "queue")):
        result = cli("pause", name, "--url", database_url)
        assert result.returncode == 2, result
        assert says in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert count(no_pauses, "SELECT count(*) FROM dramatiq.queue_pauses") == 0


def test_the_relay_does_not_claim_a_paused_queue(database_url: str, make_broker: Any, no_pauses: Any) -> None:
    broker = make_broker()
    broker.declare_queue("outbound")
    target = StubBroker()
    target.declare_queue("outbound")
    relay = Relay(broker, target, ["outbound"])
    broker.enqueue(dramatiq.Message(queue_name="outbound", actor_name="x", args=(), kwargs={}, options={}))
    assert cli("pause", "outbound", "--url", database_url).returncode == 0
    assert relay.run_once() == 0
    assert cli("resume", "outbound", "--url", database_url).returncode == 0
    assert relay.run_once() == 1


def test_the_dashboard_pauses_and_resumes_a_queue(
    make_broker: Any, no_pauses: Any, serve_dashboard: Any
) -> None:
    db = no_pauses
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="work")
    def job() -> None:
        pass

    job.send()
    server: DashboardServer = serve_dashboard()
    with httpx.Client(base_url=server.url) as browser:
        page = browser.get("/queues/work")
        assert 'id="pause"' in page.text and 'id="paused"' not in page.text
        done = browser.post("/queues/work/pause", data={"csrf_token": csrf_token(page.text)})
        assert done.status_code == 303
        page = browser.get(done.headers["location"])
        assert "Paused queue work" in page.text and 'id="paused"' in page.text and 'id="resume"' in page.text
        assert "paused</span>" in browser.get("/").text
        assert count(db, "SELECT count(*) FROM dramatiq.queue_pauses") == 2
        done = browser.post("/queues/work/resume", data={"csrf_token": csrf_token(page.text)})
        assert "Resumed queue work" in browser.get(done.headers["location"]).text
        assert count(db, "SELECT count(*) FROM dramatiq.queue_pauses") == 0
    # A read-only dashboard shows no button and refuses the action
    server = serve_dashboard(read_only=True)
    with httpx.Client(base_url=server.url) as browser:
        page = browser.get("/queues/work")
        assert 'id="pause"' not in page.text
        assert browser.post("/queues/work/pause", data={}).status_code in (400, 403)
    assert count(db, "SELECT count(*) FROM dramatiq.queue_pauses") == 0
