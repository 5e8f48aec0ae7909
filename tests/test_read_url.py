"""``read_url``: the dashboard, ``status`` and the metrics exporter read from a hot standby.

A real primary and its streaming standby (``standby_pair``, throwaway servers).  To tell
where a read came from, the standby's replay is paused: what the primary commits then is
not on the standby, whose lag is shown; an action still writes on the primary.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.cli import main
from dramatiq_pg_outbox.metrics import DatabaseCollector
from dramatiq_pg_outbox.testing import ThrowawayPostgres, free_port

from .helpers import wait_for


@pytest.fixture
def primary(standby: ThrowawayPostgres) -> ThrowawayPostgres:
    assert standby.primary is not None
    return standby.primary


@pytest.fixture
def queue() -> str:
    return f"rq_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def send(primary: ThrowawayPostgres, queue: str) -> Iterator[Any]:
    """``send()`` stores one message of ``queue`` on the primary (a real broker's send)."""
    broker = PostgresBroker(url=primary.url)

    @dramatiq.actor(broker=broker, queue_name=queue)
    def ship(n: int) -> None: ...

    yield lambda: ship.send(1)
    broker.close()
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute("DELETE FROM dramatiq.messages WHERE queue_name = %s", (queue,))
        conn.execute("DELETE FROM dramatiq.queue_pauses WHERE queue_name LIKE %s", (f"{queue}%",))


def status(capsys: pytest.CaptureFixture[str], *args: str, code: int = 0) -> tuple[str, str]:
    assert main(["status", *args]) == code
    captured = capsys.readouterr()
    return captured.out, captured.err


def status_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    out, _ = status(capsys, "--json", *args)
    return json.loads(out)  # type: ignore[no-any-return]


def queues_in(report: dict[str, Any]) -> set[str]:
    return {row["queue"] for row in report["messages"]}


def test_status_reads_from_the_standby_and_shows_its_lag(
    capsys: pytest.CaptureFixture[str], primary: ThrowawayPostgres, standby: ThrowawayPostgres, queue: str,
    send: Any,
) -> None:  # fmt: skip
    # Given the standby's replay paused, and a message stored on the primary after that
    standby.pause_replay()
    send()
    # Then the primary's status lists its queue, the standby's does not, and says it lags
    assert queue in queues_in(status_json(capsys, "--url", primary.url))
    lagging = status_json(capsys, "--url", primary.url, "--read-url", standby.url)
    assert queue not in queues_in(lagging)
    lag = lagging["read_lag"]
    assert lag["standby"] and lag["paused"] and lag["behind_bytes"] > 0 and lag["seconds"] > 0
    text, _ = status(capsys, "--url", primary.url, "--read-url", standby.url)
    first = text.splitlines()[0]
    assert first.startswith("Reads from a standby, ") and "s behind the primary" in first
    assert first.endswith("replay is paused") and queue not in text
    # When replay resumes, the standby catches up: its lag is 0 however old its last commit
    standby.resume_replay()
    report: dict[str, Any] = {}

    def caught_up() -> bool:
        report.update(status_json(capsys, "--url", primary.url, "--read-url", standby.url))
        return bool(report["read_lag"]["behind_bytes"] == 0)

    wait_for(caught_up, 30, "the standby to catch up")
    assert queue in queues_in(report)
    assert report["read_lag"]["seconds"] == 0 and report["read_lag"]["replayed_at"] is not None
    assert "caught up with the primary" in report["read_lag"]["text"]


def test_status_with_a_read_url_that_is_no_standby_says_so(
    capsys: pytest.CaptureFixture[str], primary: ThrowawayPostgres
) -> None:
    report = status_json(capsys, "--url", primary.url, "--read-url", primary.url)
    assert report["read_lag"]["standby"] is False and report["read_lag"]["seconds"] == 0
    assert "not a standby" in report["read_lag"]["text"]


def test_an_unreachable_read_url_is_one_line(
    capsys: pytest.CaptureFixture[str], primary: ThrowawayPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    nowhere = f"postgresql://postgres:hunter22@127.0.0.1:{free_port()}/postgres"
    monkeypatch.setenv("DATABASE_READ_URL", nowhere)
    _, err = status(capsys, "--url", primary.url, code=1)
    assert len(err.strip().splitlines()) == 1
    assert "the read URL (postgresql://postgres:***@127.0.0.1" in err and "connection refused" in err
    assert "hunter22" not in err


def test_the_metrics_gauges_come_from_the_standby_with_its_lag(
    primary: ThrowawayPostgres, standby: ThrowawayPostgres, queue: str, send: Any
) -> None:
    standby.pause_replay()
    send()
    on_primary = DatabaseCollector(primary.url, cache_seconds=0)
    on_standby = DatabaseCollector(primary.url, cache_seconds=0, read_url=standby.url)
    try:
        assert (queue, "due") in on_primary.read().messages
        assert on_primary.read().read_lag is None
        snap = on_standby.read()
        assert snap.up and (queue, "due") not in snap.messages
        assert snap.read_lag is not None and snap.read_lag.behind_bytes and snap.read_lag.seconds
        samples = {m.name: [s.value for s in m.samples] for m in on_standby.collect()}
        assert samples["dramatiq_pg_outbox_read_lag_seconds"][0] > 0
        assert samples["dramatiq_pg_outbox_read_lag_bytes"][0] > 0
        assert "dramatiq_pg_outbox_read_lag_seconds" not in {m.name for m in on_primary.collect()}
        # Once caught up: the message is counted, the lag is 0
        standby.resume_replay()
        wait_for(lambda: (queue, "due") in on_standby.read().messages, 30, "the standby to replay")
        wait_for(lambda: on_standby.read().read_lag.behind_bytes == 0, 30, "no lag")  # type: ignore[union-attr]
    finally:
        on_primary.close()
        on_standby.close()


def test_the_dashboard_reads_from_the_standby_and_acts_on_the_primary(
    primary: ThrowawayPostgres, standby: ThrowawayPostgres, queue: str, send: Any
) -> None:
    httpx = pytest.importorskip("httpx")
    from tests.dashboard_support import DashboardServer, Settings, csrf_token

    send()
    standby.wait_replayed()
    server = DashboardServer(Settings(url=primary.url, read_url=standby.url)).start()
    try:
        _dashboard_session(httpx, server.url, primary, standby, queue, csrf_token)
    finally:
        server.stop()
    with psycopg.connect(primary.url, autocommit=True) as conn:
        paused = {r[0] for r in conn.execute("SELECT queue_name FROM dramatiq.queue_pauses")}
        audit = conn.execute(
            "SELECT action, count FROM dramatiq.audit WHERE target = %s", (queue,)
        ).fetchall()
        conn.execute("DELETE FROM dramatiq.messages WHERE queue_name = %s", (f"{queue}_b",))
    with psycopg.connect(standby.url, autocommit=True) as conn:
        on_standby = {r[0] for r in conn.execute("SELECT queue_name FROM dramatiq.queue_pauses")}
    # Then the pause was written on the primary (and is not on the paused standby)
    assert queue in paused and queue not in on_standby
    assert audit == [("pause", 1)]


def _dashboard_session(
    httpx: Any, url: str, primary: ThrowawayPostgres, standby: ThrowawayPostgres, queue: str, csrf_token: Any
) -> None:
    with httpx.Client(base_url=url) as browser:
        page = browser.get("/").text
        assert queue in page and "caught up with the primary" in page
        # Given replay paused and a message sent to a second queue on the primary
        standby.pause_replay()
        other = PostgresBroker(url=primary.url)
        try:

            def pack() -> None: ...

            dramatiq.actor(pack, broker=other, queue_name=f"{queue}_b").send()
        finally:
            other.close()
        # Then the queues page does not list it, and says how far behind it reads
        page = browser.get("/").text
        assert f"{queue}_b" not in page and 'id="read-lag"' in page
        assert "behind the primary" in page and "replay is paused" in page
        # When an operator pauses the queue: the pause is written on the primary
        token = csrf_token(browser.get(f"/queues/{queue}").text)
        done = browser.post(f"/queues/{queue}/pause", data={"csrf_token": token})
        assert done.status_code in (200, 303)


def test_the_exporter_serves_the_standby_s_gauges_while_the_primary_is_not_reached(
    standby: ThrowawayPostgres,
) -> None:
    # Given a primary URL that nothing answers and a standby that does
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    collector = DatabaseCollector(nowhere, cache_seconds=0, read_url=standby.url)
    try:
        snap = collector.read()
        families = {m.name: [s.value for s in m.samples] for m in collector.collect()}
    finally:
        collector.close()
    # Then the gauges are up, the bytes behind unknown, the lag the age of the last replayed commit
    assert snap.up and snap.read_lag is not None
    assert snap.read_lag.behind_bytes is None and snap.read_lag.primary_error
    assert snap.read_lag.seconds is not None and snap.read_lag.seconds > 0
    assert "the primary was not reached" in snap.read_lag.describe()
    assert families["dramatiq_pg_outbox_read_lag_bytes"] == []
    (seconds,) = families["dramatiq_pg_outbox_read_lag_seconds"]  # (a new reading: cache_seconds=0)
    assert seconds >= snap.read_lag.seconds


def test_the_metrics_command_serves_the_standby_s_lag(
    primary: ThrowawayPostgres, standby: ThrowawayPostgres
) -> None:
    pytest.importorskip("prometheus_client")
    from tests.test_metrics import MetricsServer

    exporter = MetricsServer(primary.url, "--read-url", standby.url, "--cache-seconds", "0")
    try:
        scraped = exporter.scrape()
    finally:
        exporter.stop()
    assert scraped[("dramatiq_pg_outbox_database_up", ())] == 1.0
    assert ("dramatiq_pg_outbox_read_lag_seconds", ()) in scraped
    assert ("dramatiq_pg_outbox_read_lag_bytes", ()) in scraped
    out = exporter.proc.stdout.read() if exporter.proc.stdout else ""
    assert f"read from {standby.url}" in out


def test_the_dashboard_command_names_an_unreachable_read_url_in_one_line(
    capsys: pytest.CaptureFixture[str], primary: ThrowawayPostgres
) -> None:
    pytest.importorskip("uvicorn")
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    assert main(["dashboard", "--url", primary.url, "--read-url", nowhere, "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dramatiq-pg-outbox dashboard: error: the read URL")
    assert "connection refused" in err
