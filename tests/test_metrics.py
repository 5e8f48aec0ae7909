"""Prometheus metrics against a real PostgreSQL, real HTTP servers and real ``dramatiq`` workers.

The database gauges are scraped from the ``dramatiq-pg-outbox metrics`` command over
HTTP and parsed with ``prometheus_client.parser``; the expected values come from
the test's own queries of the tables.  The worker counters are scraped from the
exposition server of Dramatiq's own ``Prometheus`` middleware, which serves its
metrics and ours from the multiprocess directory of a ``dramatiq`` CLI run.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.metrics import DatabaseCollector
from dramatiq_pg_outbox.testing import ThrowawayPostgres

from .helpers import count, wait_for

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of one scrape of ``http://127.0.0.1:port/metrics``."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    """The sum of a metric's samples over all its labels."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


class MetricsServer:
    """``dramatiq-pg-outbox metrics`` in a subprocess, on a free port."""

    def __init__(self, url: str, *options: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq_pg_outbox.cli", "metrics", "--url", url,
             "--port", str(self.port), *options],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

        def listening() -> bool:
            assert self.proc.poll() is None, self.proc.communicate()
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(listening, 30, "the metrics command to listen")

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def metrics_server(database_url: str) -> Iterator[Any]:
    servers: list[MetricsServer] = []

    def start(*options: str) -> MetricsServer:
        server = MetricsServer(database_url, *options)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def table_gauges(db: psycopg.Connection[Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the gauges should say, from the test's own queries (written apart from the package's)."""
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    queues = [r[0] for r in db.execute("SELECT DISTINCT queue_name FROM dramatiq.messages").fetchall()]
    for queue in queues:
        for state, where in (
            ("due", "state = 'pending' AND next_attempt_at <= now()"),
            ("delayed", "state = 'pending' AND next_attempt_at > now()"),
            ("processing", "state = 'processing'"),
        ):
            n = count(
                db, f"SELECT count(*) FROM dramatiq.messages WHERE queue_name = %s AND {where}", (queue,)
            )
            expected[("dramatiq_pg_outbox_messages", (("queue_name", queue), ("state", state)))] = n
    for queue, n in db.execute(
        "SELECT queue_name, count(*) FROM dramatiq.history "
        "WHERE state = 'failed' AND finished_at > now() - interval '1 hour' GROUP BY 1"
    ).fetchall():
        expected[("dramatiq_pg_outbox_dead_letters_last_hour", (("queue_name", queue),))] = n
    live = count(
        db, "SELECT count(*) FROM dramatiq.workers WHERE heartbeat_at > now() - interval '20 seconds'"
    )
    expected[("dramatiq_pg_outbox_live_workers", ())] = live
    expected[("dramatiq_pg_outbox_database_up", ())] = 1
    return expected


def seed(db: psycopg.Connection[Any], broker: PostgresBroker) -> None:
    """Messages in every state of two queues, dead letters old and new, workers live and dead."""
    import dramatiq

    emails = dramatiq.actor(lambda: None, broker=broker, actor_name="email", queue_name="emails")
    reports = dramatiq.actor(lambda: None, broker=broker, actor_name="report", queue_name="reports")
    for _ in range(3):
        emails.send()
    for _ in range(2):
        emails.send_with_options(delay=3_600_000)
    for _ in range(4):
        reports.send()
    # One email waited 100 s since it became due; two reports are being processed.
    db.execute(
        "UPDATE dramatiq.messages SET next_attempt_at = now() - interval '100 seconds' "
        "WHERE id = (SELECT min(id) FROM dramatiq.messages WHERE queue_name = 'emails')"
    )
    db.execute(
        "UPDATE dramatiq.messages SET state = 'processing', lease = gen_random_uuid(), "
        "owner = gen_random_uuid(), acquired_at = now() "
        "WHERE id IN (SELECT id FROM dramatiq.messages WHERE queue_name = 'reports' LIMIT 2)"
    )
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, "
        "finished_at, error_type, error, payload) VALUES "
        "(-1, 'emails', 'email', 'a', 'failed', 1, now(), now() - interval '5 minutes', 'E', 'e', ''), "
        "(-2, 'emails', 'email', 'b', 'failed', 1, now(), now() - interval '2 hours', 'E', 'e', ''), "
        "(-3, 'reports', 'report', 'c', 'failed', 1, now(), now(), 'E', 'e', ''), "
        "(-4, 'reports', 'report', 'd', 'completed', 1, now(), now(), NULL, NULL, '')"
    )
    db.execute(
        "INSERT INTO dramatiq.workers (id, hostname, pid, heartbeat_at, queues) VALUES "
        "(gen_random_uuid(), 'a', 1, now(), '{emails,emails.DQ}'), "
        "(gen_random_uuid(), 'b', 2, now(), '{emails,reports}'), "
        "(gen_random_uuid(), 'gone', 3, now() - interval '10 minutes', '{reports}')"
    )
    # Finished messages counted in two shards, and in a delay queue
    db.execute(
        "INSERT INTO dramatiq.finished_counts (queue_name, actor_name, state, shard, n) VALUES "
        "('reports', 'report', 'completed', 3, 5), ('reports', 'report', 'completed', 7, 2), "
        "('emails', 'email', 'failed', 0, 1), ('emails.DQ', 'email', 'failed', 4, 2)"
    )
    # A schedule whose tick is 90 s overdue, and a disabled one further behind
    db.execute(
        "INSERT INTO dramatiq.schedules (name, actor_name, queue_name, every_ms, next_run_at, "
        "disabled_at) VALUES "
        "('metrics_beat', 'email', 'emails', 60000, now() - interval '90 seconds', NULL), "
        "('metrics_off', 'email', 'emails', 60000, now() - interval '1 hour', now())"
    )


def test_the_scraped_gauges_match_the_tables(db: Any, broker: PostgresBroker, metrics_server: Any) -> None:
    # Given messages due, delayed and processing in two queues, dead letters and workers
    seed(db, broker)
    # When Prometheus scrapes the metrics command (no cache)
    samples = metrics_server("--cache-seconds", "0").scrape()
    # Then every gauge is what the tables say
    expected = table_gauges(db)
    assert {key: samples.get(key) for key in expected} == expected
    assert expected[("dramatiq_pg_outbox_messages", (("queue_name", "emails"), ("state", "delayed")))] == 2
    assert expected[("dramatiq_pg_outbox_live_workers", ())] == 2
    # And the oldest due email waited the 100 s it was made to (plus the test's own seconds)
    emails_age = samples[("dramatiq_pg_outbox_oldest_due_message_age_seconds", (("queue_name", "emails"),))]
    db_age = float(
        db.execute(
            "SELECT extract(epoch FROM now() - min(next_attempt_at)) FROM dramatiq.messages "
            "WHERE queue_name = 'emails' AND state = 'pending' AND next_attempt_at <= now()"
        ).fetchone()[0]
    )
    assert 100 <= emails_age <= db_age

    # And the newer gauges: live workers per queue (a worker of emails and emails.DQ counts once),
    # the age of the oldest claim, an enabled schedule's lateness (not a disabled one's)
    def sample(name: str, **labels: str) -> float:
        return samples[(f"dramatiq_pg_outbox_{name}", tuple(sorted(labels.items())))]

    assert sample("queue_live_workers", queue_name="emails") == 2
    assert sample("queue_live_workers", queue_name="reports") == 1
    assert 0 <= sample("oldest_running_message_age_seconds", queue_name="reports") < 60
    assert sample("oldest_running_message_age_seconds", queue_name="emails") == 0
    assert 90 <= sample("schedule_lateness_seconds", schedule="metrics_beat", queue_name="emails") < 150
    assert not [key for key in samples if ("schedule", "metrics_off") in key[1]]
    # And the finished counters sum their shards, fold a delay queue, and serve every outcome
    finished = {
        dict(labels)["queue_name"] + "/" + dict(labels)["actor_name"] + "/" + dict(labels)["state"]: value
        for (name, labels), value in samples.items()
        if name == "dramatiq_pg_outbox_messages_finished_total"
    }
    assert finished == {
        "emails/email/completed": 0, "emails/email/retried": 0, "emails/email/failed": 3,
        "emails/email/canceled": 0,
        "reports/report/completed": 7, "reports/report/retried": 0, "reports/report/failed": 0,
        "reports/report/canceled": 0,
    }  # fmt: skip
    # And the example alerting rules name only metrics that are served
    alerts = (ROOT / "docs" / "prometheus-alerts.yml").read_text()
    served = {name for name, _ in samples}
    assert set(re.findall(r"dramatiq_pg_outbox_\w+", alerts)) <= served
    # And the Grafana dashboard queries exactly the served series, each of them
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert {name for e in exprs for name in re.findall(r"dramatiq_pg_outbox_\w+", e)} == served
    # And no other metric family appears
    assert {name for name, _ in samples} == {
        "dramatiq_pg_outbox_database_up",
        "dramatiq_pg_outbox_messages",
        "dramatiq_pg_outbox_oldest_due_message_age_seconds",
        "dramatiq_pg_outbox_dead_letters_last_hour",
        "dramatiq_pg_outbox_dead_lettered_total",
        "dramatiq_pg_outbox_live_workers",
        "dramatiq_pg_outbox_queue_paused",
        "dramatiq_pg_outbox_oldest_running_message_age_seconds",
        "dramatiq_pg_outbox_queue_live_workers",
        "dramatiq_pg_outbox_schedule_lateness_seconds",
        "dramatiq_pg_outbox_messages_finished_total",
    }


def test_a_delay_queue_folds_into_its_queue(db: Any, broker: PostgresBroker, metrics_server: Any) -> None:
    # Given due messages stored on a delay queue's name (as Dramatiq names them: X.DQ) and on X
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload, next_attempt_at) "
        "SELECT q, 'email', gen_random_uuid()::text, '', now() - interval '50 seconds' "
        "FROM unnest(ARRAY['emails', 'emails.DQ', 'emails.DQ']) AS q"
    )
    # When scraped
    samples = metrics_server("--cache-seconds", "0").scrape()
    # Then they are one queue's: counts add up, and no emails.DQ series exists
    assert samples[("dramatiq_pg_outbox_messages", (("queue_name", "emails"), ("state", "due")))] == 3
    assert not [key for key in samples if ("queue_name", "emails.DQ") in key[1]]


def test_scrapes_within_the_cache_window_reuse_one_reading(
    db: Any, broker: PostgresBroker, metrics_server: Any
) -> None:
    import dramatiq

    work = dramatiq.actor(lambda: None, broker=broker, actor_name="work", queue_name="work")
    work.send()
    # Given the command with a long cache, scraped once
    server = metrics_server("--cache-seconds", "600")
    key = ("dramatiq_pg_outbox_messages", (("queue_name", "work"), ("state", "due")))
    assert server.scrape()[key] == 1
    # When more messages arrive and it is scraped again
    for _ in range(4):
        work.send()
    # Then the second scrape is the cached reading, not a new statement
    assert server.scrape()[key] == 1


def test_concurrent_scrapes_share_one_statement_and_the_cache_expires(database_url: str, db: Any) -> None:
    collector = DatabaseCollector(database_url, cache_seconds=0.5)
    try:
        # Given 8 scrapers at once
        barrier = threading.Barrier(8)

        def scraper() -> None:
            barrier.wait()
            list(collector.collect())

        threads = [threading.Thread(target=scraper) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # Then they ran one statement
        assert collector.statements == 1
        # And once the cache is older than cache_seconds, the next scrape reads again
        wait_for(lambda: (list(collector.collect()), collector.statements)[1] == 2, 10, "a fresh reading")
    finally:
        collector.close()


def test_a_lost_database_is_reported_as_down_and_the_next_scrape_reconnects(
    database_url: str, db: Any
) -> None:
    collector = DatabaseCollector(database_url, cache_seconds=0)
    try:
        assert collector.read().up
        # Given its connection is terminated (a failover, a restart)
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%%UNION ALL%%'"
        )
        # Then one scrape says down, with the error kept, and the next one is up again
        down = collector.read()
        assert not down.up and collector.last_error
        assert collector.read().up and collector.last_error is None
    finally:
        collector.close()


def test_the_gauges_follow_a_drain_by_real_workers(
    db: Any, producer: Any, worker_process: Any, metrics_server: Any
) -> None:
    # Given 300 messages waiting and the metrics command (1 s cache)
    producer.broker.enqueue_many([producer.record.message(f"m{i}") for i in range(300)])
    server = metrics_server("--cache-seconds", "1")
    key = ("dramatiq_pg_outbox_messages", (("queue_name", "default"), ("state", "due")))
    assert server.scrape()[key] == 300
    # When a worker drains them, scraped every 0.2 s
    worker = worker_process(threads=2)
    seen: list[float] = []

    def drained() -> bool:
        samples = server.scrape()
        seen.append(sum(v for (name, labels), v in samples.items() if name == "dramatiq_pg_outbox_messages"))
        return seen[-1] == 0 and samples[("dramatiq_pg_outbox_live_workers", ())] >= 1

    wait_for(drained, 120, "the gauges to show the queue drained and the worker live")
    assert worker.stop() == 0
    # Then the waiting count only went down, and at the end the gauges match the tables
    assert seen == sorted(seen, reverse=True) and seen[0] == 300
    assert count(db, "SELECT count(*) FROM received") == 300
    expected = table_gauges(db)
    samples = server.scrape()
    assert {key: samples.get(key) for key in expected} == expected


def test_worker_counters_are_served_beside_dramatiqs_own_prometheus_metrics(
    db: Any, producer: Any, worker_process: Any, tmp_path: Path
) -> None:
    # Given 40 messages, 5 of them failing with max_retries=0
    messages = [producer.record.message(f"ok{i}") for i in range(35)]
    messages += [producer.fail.message(f"bad{i}") for i in range(5)]
    producer.broker.enqueue_many(messages)
    # When a `dramatiq` CLI run of 2 processes with Dramatiq's Prometheus middleware and ours drains them
    port = free_port()
    env = {"DPO_METRICS": "1", "dramatiq_prom_db": str(tmp_path), "dramatiq_prom_port": str(port)}
    env["dramatiq_prom_host"] = "127.0.0.1"
    worker = worker_process(processes=2, threads=2, env=env)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history") == 40, 120, "40 messages finished")

    def counted() -> bool:
        try:
            samples = scrape(port)
        except httpx.TransportError:
            return False
        return (
            total(samples, "dramatiq_pg_outbox_acked_total")
            + total(samples, "dramatiq_pg_outbox_nacked_total")
            == 40
        )

    wait_for(counted, 30, "the exposition server to serve 40 decisions")
    samples = scrape(port)
    assert worker.stop() == 0
    # Then our counters (over both processes) match what the history table holds
    failed = count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'")
    assert failed == 5
    assert samples[("dramatiq_pg_outbox_acked_total", (("queue_name", "default"),))] == 35
    assert samples[("dramatiq_pg_outbox_nacked_total", (("queue_name", "default"),))] == 5
    assert samples[("dramatiq_pg_outbox_claimed_total", (("queue_name", "default"),))] == 40
    assert total(samples, "dramatiq_pg_outbox_claim_duration_seconds_count") >= 1
    flushes = total(samples, "dramatiq_pg_outbox_flush_duration_seconds_count")
    assert flushes >= 2  # at least one ack and one nack statement
    assert total(samples, "dramatiq_pg_outbox_stale_decisions_total") == 0
    # And Dramatiq's own metrics are there too, unchanged, counting the same 40 messages
    assert total(samples, "dramatiq_messages_total") == 40
    assert total(samples, "dramatiq_message_rejects_total") == 5
    # And both worker processes wrote to the multiprocess directory
    assert len(list(tmp_path.glob("counter_*.db"))) >= 2


def test_the_command_explains_a_missing_schema_and_a_busy_port_in_one_line(
    database_url: str, db: Any
) -> None:
    base = [sys.executable, "-m", "dramatiq_pg_outbox.cli", "metrics", "--url", database_url]
    # A schema that was never migrated
    missing = subprocess.run([*base, "--schema", "nowhere"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1 and "dramatiq-pg-outbox migrate" in missing.stderr
    assert "Traceback" not in missing.stderr
    # A port something else listens on
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = subprocess.run([*base, "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1
    assert taken.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    # A negative cache
    bad = subprocess.run([*base, "--cache-seconds", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be 0 or more" in bad.stderr


def test_a_queue_that_empties_reads_zero_instead_of_vanishing(
    database_url: str, db: Any, broker: PostgresBroker
) -> None:
    import dramatiq

    @dramatiq.actor(broker=broker, queue_name="vanishing")
    def job() -> None:
        pass

    collector = DatabaseCollector(database_url, cache_seconds=0)

    def series() -> dict[tuple[str, str], float]:
        return {
            (family.name, sample.labels.get("state", "")): sample.value
            for family in collector.collect()
            for sample in family.samples
            if sample.labels.get("queue_name") == "vanishing"
        }

    try:
        # Given a queue with a due message, scraped once
        job.send()
        assert series()[("dramatiq_pg_outbox_messages", "due")] == 1
        # When the queue empties
        db.execute("DELETE FROM dramatiq.messages WHERE queue_name = 'vanishing'")
        # Then its series are still served, at 0 (rate() and absent() alerts keep working)
        after = series()
        assert after[("dramatiq_pg_outbox_messages", "due")] == 0
        assert after[("dramatiq_pg_outbox_oldest_due_message_age_seconds", "")] == 0
        assert after[("dramatiq_pg_outbox_dead_letters_last_hour", "")] == 0
    finally:
        collector.close()


def test_dead_letters_are_a_counter_that_prune_does_not_lower(
    database_url: str, db: Any, make_broker: Any, start_worker: Any
) -> None:
    import dramatiq

    # Given an actor without retries that fails, and a worker
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="imports", max_retries=0)
    def load(i: int) -> None:
        raise ValueError(f"row {i} is malformed")

    @dramatiq.actor(broker=broker, queue_name="imports", max_retries=1, min_backoff=10, max_backoff=10)
    def flaky(i: int) -> None:
        raise ValueError("always")

    collector = DatabaseCollector(database_url, cache_seconds=0)

    def counter() -> float:
        return next(
            sample.value
            for family in collector.collect()
            for sample in family.samples
            if sample.name == "dramatiq_pg_outbox_dead_lettered_total"
            and sample.labels["queue_name"] == "imports"
        )

    try:
        # When two messages fail for good, and one fails, is retried and fails for good
        load.send(1)
        load.send(2)
        flaky.send(3)
        start_worker(broker)
        wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 3, 30,
                 "three dead letters")  # fmt: skip
        # Then the counter says 3 (a retried failure is not a dead letter; its retry's is)
        assert counter() == 3
        # When history is pruned (everything older than a second)
        time.sleep(1.2)
        result = subprocess.run(
            [sys.executable, "-m", "dramatiq_pg_outbox.cli", "prune", "--older-than", "1s",
             "--url", database_url],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert count(db, "SELECT count(*) FROM dramatiq.history") == 0
        # Then the counter keeps its value; the windowed gauge, read from history, falls
        assert counter() == 3
        samples = {
            sample.name: sample.value
            for family in collector.collect()
            for sample in family.samples
            if sample.labels.get("queue_name") == "imports"
        }
        assert samples["dramatiq_pg_outbox_dead_letters_last_hour"] == 0
    finally:
        collector.close()


def test_the_command_starts_with_the_database_down_and_reports_it_until_it_answers() -> None:
    # Given a migrated database whose server is down when the exporter starts
    try:
        server = ThrowawayPostgres()
    except RuntimeError as e:
        pytest.skip(f"no local PostgreSQL binaries for a private server: {e}")
    with server:
        upgrade(server.url)
        server.stop(keep_data=True)
        exporter = MetricsServer(server.url, "--cache-seconds", "0")
        try:
            # Then it serves, says why on one line, and reports the database down
            assert exporter.scrape()[("dramatiq_pg_outbox_database_up", ())] == 0.0
            # And once the server is back, the next scrape reads the tables
            server.start()
            wait_for(lambda: exporter.scrape()[("dramatiq_pg_outbox_database_up", ())] == 1.0, 30,
                     "the exporter to see the database")  # fmt: skip
            assert ("dramatiq_pg_outbox_live_workers", ()) in exporter.scrape()
        finally:
            exporter.stop()
        err = exporter.proc.stderr.read() if exporter.proc.stderr else ""
        lines = [line for line in err.splitlines() if "warning" in line]
        assert len(lines) == 1 and "connection refused" in lines[0], err
        assert "serving dramatiq_pg_outbox_database_up 0 until it answers" in lines[0]
        assert "Traceback" not in err


def test_finished_messages_are_counted_per_actor_from_the_database_and_prune_does_not_lower_them(
    database_url: str, db: Any, make_broker: Any, start_worker: Any, metrics_server: Any
) -> None:
    import dramatiq

    # Given a queue with an actor that succeeds, one that fails after a retry and one without retries
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="billing")
    def charge(i: int) -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name="billing", max_retries=1, min_backoff=10, max_backoff=10)
    def flaky(i: int) -> None:
        raise ValueError("card declined")

    @dramatiq.actor(broker=broker, queue_name="billing", max_retries=0)
    def doomed(i: int) -> None:
        raise KeyError("no such customer")

    def finished() -> dict[tuple[str, str], float]:
        return {
            (dict(labels)["actor_name"], dict(labels)["state"]): value
            for (name, labels), value in server.scrape().items()
            if name == "dramatiq_pg_outbox_messages_finished_total" and ("queue_name", "billing") in labels
        }

    def history_counts() -> dict[tuple[str, str], float]:
        """The same counts from history, by the test's own query."""
        rows = db.execute(
            "SELECT actor_name, CASE WHEN state = 'failed' THEN 'failed' WHEN error_type IS NULL "
            "THEN 'completed' ELSE 'retried' END, count(*) FROM dramatiq.history GROUP BY 1, 2"
        ).fetchall()
        return {(actor, state): float(n) for actor, state, n in rows}

    server = metrics_server("--cache-seconds", "0")
    # When a worker runs 4 charges, 2 flaky messages (each retried once) and 1 doomed message
    for i in range(4):
        charge.send(i)
    for i in range(2):
        flaky.send(i)
    doomed.send(0)
    start_worker(broker)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history") == 9, 60, "nine finished deliveries")
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the queue drained")
    # Then the exporter serves the counts per actor and outcome, every outcome of each actor
    expected = {
        ("charge", "completed"): 4.0, ("charge", "retried"): 0.0, ("charge", "failed"): 0.0,
        ("flaky", "completed"): 0.0, ("flaky", "retried"): 2.0, ("flaky", "failed"): 2.0,
        ("doomed", "completed"): 0.0, ("doomed", "retried"): 0.0, ("doomed", "failed"): 1.0,
        ("charge", "canceled"): 0.0, ("flaky", "canceled"): 0.0, ("doomed", "canceled"): 0.0,
    }  # fmt: skip
    assert finished() == expected
    # And they are history's counts, and the failures are the queue's dead letters
    assert history_counts() == {key: value for key, value in expected.items() if value}
    samples = server.scrape()
    assert samples[("dramatiq_pg_outbox_dead_lettered_total", (("queue_name", "billing"),))] == 3
    # When history is pruned (everything older than a second)
    time.sleep(1.2)
    result = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_outbox.cli", "prune", "--older-than", "1s",
         "--url", database_url],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert count(db, "SELECT count(*) FROM dramatiq.history") == 0
    # Then the counters keep their values
    assert finished() == expected
    # And later messages add to them
    charge.send(4)
    doomed.send(1)
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history") == 2, 30, "two more finished")
    assert finished() == {**expected, ("charge", "completed"): 5.0, ("doomed", "failed"): 2.0}
