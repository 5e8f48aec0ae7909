"""OpenTelemetry: one trace from a request's span, through send() (in outbox() or not), into the actor.

The test process is the web application: an SDK tracer provider of its own (the global one
is left alone) with an in-memory exporter.  The workers are real ``dramatiq`` processes
running tests/worker_app.py with the SDK exporting to JSON-lines files
(``DPO_OTEL_SPANS``, tests/otel_spans.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dramatiq
import pytest

pytest.importorskip("opentelemetry.sdk", reason="pip install -e '.[dev]' (opentelemetry-sdk)")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import outbox
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.tracing import (
    ACTOR_NAME,
    DEAD_LETTERED,
    DELIVERY_COUNT,
    ENQUEUE_PATH,
    OPTION,
    TracingMiddleware,
)
from tests.helpers import count, reachable, wait_for
from tests.otel_spans import read_spans, span_record

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def web(make_broker: Any, exporter: InMemorySpanExporter) -> Any:
    """The producing side: a broker with the middleware and a provider of its own, and
    stand-ins for tests/worker_app.py's actors (same names and queue; bodies never run here)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    broker = make_broker()
    broker.add_middleware(TracingMiddleware(tracer_provider=provider))

    class Web:
        tracer = provider.get_tracer("web")

    for name in ("record", "traced_record", "fail", "crash_once", "fail_once"):
        setattr(Web, name, dramatiq.actor(lambda key: None, actor_name=name, broker=broker, max_retries=0))
    Web.broker = broker  # type: ignore[attr-defined]
    return Web


@contextmanager
def web_request(provider: TracerProvider) -> Iterator[Any]:
    """A span standing for the web request that sends."""
    with provider.get_tracer("web").start_as_current_span("web request") as span:
        yield span


def _process_spans(directory: Path, n: int) -> dict[str, dict[str, Any]]:
    """The workers' ``process`` spans by message id, once there are ``n``."""
    wait_for(
        lambda: sum(s["kind"] == "CONSUMER" for s in read_spans(directory)) >= n, 30, f"{n} process spans"
    )
    spans = read_spans(directory)
    return {s["attributes"]["messaging.message.id"]: s for s in spans if s["kind"] == "CONSUMER"}


def _expect_messaging(span: dict[str, Any], operation: str, message: dramatiq.Message[Any]) -> None:
    assert span["name"] == f"{operation} default"
    attributes = span["attributes"]
    assert attributes["messaging.system"] == "dramatiq_pg_outbox"
    assert attributes["messaging.operation.type"] == operation
    assert attributes["messaging.operation.name"] == operation
    assert attributes["messaging.destination.name"] == "default"
    assert attributes["messaging.message.id"] == message.message_id
    assert attributes[ACTOR_NAME] == message.actor_name


def test_one_trace_runs_from_the_request_through_the_outbox_and_send_into_the_actors(
    web: Any, exporter: InMemorySpanExporter, worker_process: Any, db: Any, database_url: str, tmp_path: Path
) -> None:
    # Given a worker process whose spans go to files, and a web request's span
    worker_process(threads=2, env={"DPO_OTEL_SPANS": str(tmp_path)})
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    with web.tracer.start_as_current_span("web request") as request:
        # When the request sends in its own transaction, on the broker's pool, and a message that fails
        with Session(engine) as session:
            with outbox(session):
                in_outbox = web.traced_record.send("outbox")
            session.commit()
        on_pool = web.record.send("pool")
        failing = web.fail.send("failing")
    engine.dispose()
    sent = [in_outbox, on_pool, failing]
    processed = _process_spans(tmp_path, 3)
    assert count(db, "SELECT count(*) FROM received WHERE key IN ('outbox', 'pool')") == 2

    # Then the request has one PRODUCER span per message, the context the message carried
    request_ctx = request.get_span_context()
    trace_id = f"{request_ctx.trace_id:032x}"
    spans = map(span_record, exporter.get_finished_spans())
    sends = {s["attributes"]["messaging.message.id"]: s for s in spans if s["kind"] == "PRODUCER"}
    for message, path in zip(sent, ["outbox", "pool", "pool"], strict=True):
        send = sends[message.message_id]
        assert (send["kind"], send["trace_id"]) == ("PRODUCER", trace_id)
        assert send["parent_id"] == f"{request_ctx.span_id:016x}"
        _expect_messaging(send, "send", message)
        assert send["attributes"][ENQUEUE_PATH] == path
        # (W3C traceparent: version-trace id-parent id-flags, which the SDK's version may vary)
        assert message.options[OPTION]["traceparent"].startswith(f"00-{trace_id}-{send['span_id']}-")
        # And the worker's CONSUMER span continues the trace as that span's child (and links to it)
        process = processed[message.message_id]
        assert (process["kind"], process["trace_id"]) == ("CONSUMER", trace_id)
        assert process["parent_id"] == send["span_id"]
        assert process["links"] == [f"{trace_id}-{send['span_id']}"]
        _expect_messaging(process, "process", message)
        assert process["attributes"][DELIVERY_COUNT] == 1
    # The actor's own span is a child of its process span: the process span was current
    (body,) = [s for s in read_spans(tmp_path) if s["name"] == "actor body"]
    assert (body["trace_id"], body["parent_id"]) == (trace_id, processed[in_outbox.message_id]["span_id"])
    # A successful delivery is not an error; the dead-lettered one is, with its exception
    assert processed[on_pool.message_id]["status"] == "UNSET"
    assert DEAD_LETTERED not in processed[on_pool.message_id]["attributes"]
    failed = processed[failing.message_id]
    assert (failed["status"], failed["events"]) == ("ERROR", ["exception"])
    assert failed["attributes"]["error.type"] == "RuntimeError"
    assert failed["attributes"][DEAD_LETTERED] is True


def test_a_retry_is_sent_within_the_failed_delivery_and_continues_the_trace(
    web: Any, exporter: InMemorySpanExporter, worker_process: Any, db: Any, tmp_path: Path
) -> None:
    # Given a message whose first run raises, with a retry left
    worker_process(threads=1, env={"DPO_OTEL_SPANS": str(tmp_path)})
    with web.tracer.start_as_current_span("web request"):
        message = web.fail_once.send("retried")
    # When it runs, fails, is retried (the same message id) and runs again
    wait_for(lambda: count(db, "SELECT count(*) FROM received WHERE key = 'retried'") == 1, 30, "the retry")
    wait_for(lambda: sum(s["kind"] == "CONSUMER" for s in read_spans(tmp_path)) == 2, 30, "2 process spans")
    (send,) = [s for s in map(span_record, exporter.get_finished_spans()) if s["kind"] == "PRODUCER"]
    spans = read_spans(tmp_path)
    (first, second) = [s for s in spans if s["kind"] == "CONSUMER"]
    (retry,) = [s for s in spans if s["kind"] == "PRODUCER"]
    # Then the failed delivery is an error (acked: not dead-lettered), the retry is a follow-up
    # sent within it (written with its ack), and the second delivery is the retry's child
    assert first["parent_id"] == send["span_id"]
    assert (first["status"], first["attributes"]["error.type"]) == ("ERROR", "RuntimeError")
    assert DEAD_LETTERED not in first["attributes"]
    assert (retry["parent_id"], retry["attributes"][ENQUEUE_PATH]) == (first["span_id"], "follow_up")
    _expect_messaging(retry, "send", message)
    assert (second["parent_id"], second["status"]) == (retry["span_id"], "UNSET")
    _expect_messaging(second, "process", message)
    assert {s["trace_id"] for s in (send, first, retry, second)} == {send["trace_id"]}


def test_a_message_redelivered_after_its_worker_died_counts_two_deliveries(
    web: Any, exporter: InMemorySpanExporter, worker_process: Any, db: Any, tmp_path: Path
) -> None:
    # Given a message that kills the worker process on its first delivery
    with web.tracer.start_as_current_span("web request"):
        message = web.crash_once.send("again")
    first = worker_process(threads=1, env={"DPO_OTEL_SPANS": str(tmp_path)})
    assert first.proc.wait(30) != 0
    # When another worker rescues it and runs it
    worker_process(threads=1, env={"DPO_OTEL_SPANS": str(tmp_path)})
    wait_for(lambda: count(db, "SELECT count(*) FROM received WHERE key = 'again'") == 1, 30, "the rescue")
    # Then its one finished process span (the dead process exported none) says 2 deliveries,
    # the broker's count, and still continues the sender's trace
    (send,) = [s for s in map(span_record, exporter.get_finished_spans()) if s["kind"] == "PRODUCER"]
    process = _process_spans(tmp_path, 1)[message.message_id]
    assert process["attributes"][DELIVERY_COUNT] == 2
    assert (process["trace_id"], process["parent_id"]) == (send["trace_id"], send["span_id"])


def test_outside_any_span_a_message_keeps_the_context_it_carries(
    make_broker: Any, exporter: InMemorySpanExporter, db: Any
) -> None:
    # Given the middleware on a recording provider
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    broker = make_broker()
    broker.add_middleware(TracingMiddleware(tracer_provider=provider))
    record = dramatiq.actor(lambda key: None, actor_name="record", broker=broker)
    # When a message that carries a context (as one forwarded by the relay does) is sent outside any span
    carried = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}
    broker.enqueue(record.message_with_options(args=("k",), **{OPTION: carried}))
    # Then it is stored with that context, and no span starts a trace of its own
    (payload,) = db.execute("SELECT payload FROM dramatiq.messages").fetchone()
    assert dramatiq.Message.decode(bytes(payload)).options[OPTION] == carried
    assert exporter.get_finished_spans() == ()


def test_without_an_sdk_a_message_sent_outside_any_span_carries_no_context(make_broker: Any, db: Any) -> None:
    # Given the middleware on a provider that records nothing (OpenTelemetry's API without an SDK)
    broker = make_broker()
    broker.add_middleware(TracingMiddleware(tracer_provider=NoOpTracerProvider()))
    record = dramatiq.actor(lambda key: None, actor_name="record", broker=broker)
    # When a message is sent outside any span
    record.send("k")
    # Then the stored message carries no trace context
    (payload,) = db.execute("SELECT payload FROM dramatiq.messages").fetchone()
    assert OPTION not in dramatiq.Message.decode(bytes(payload)).options


def test_the_trace_continues_through_the_relay_into_a_redis_worker(
    make_broker: Any, exporter: InMemorySpanExporter, database_url: str, db: Any
) -> None:
    relay_tests = pytest.importorskip("tests.test_relay", reason="pip install -e '.[dev]' (the relay extra)")
    if not reachable("127.0.0.1", 6379):
        pytest.skip("no redis server at 127.0.0.1:6379")
    from dramatiq_pg_outbox.relay import Relay

    # Given the middleware on the outbox's broker, on the relay's Redis broker and on a Redis worker's
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    broker = make_broker()
    target = relay_tests.Target("redis", f"relay_{uuid.uuid4().hex[:10]}")
    relay_target = target.make()
    for b in (broker, target.consumer_broker, relay_target):
        b.add_middleware(TracingMiddleware(tracer_provider=provider))
    relay = relay_tests.RelayThread(Relay(broker, relay_target, [target.queue]))
    try:
        target.start_worker()
        # When a request sends in its transaction, and the relay moves the message to Redis
        send = relay_tests.producer_actor(broker, target.queue)
        engine = create_engine(normalize_sqlalchemy_url(database_url))
        with web_request(provider) as request, Session(engine) as session:
            with outbox(session):
                message = send.send("traced")
            session.commit()
        engine.dispose()
        wait_for(lambda: target.received.distinct() == {"traced"}, 30, "the relayed message run")
        wait_for(lambda: len(exporter.get_finished_spans()) >= 3, 10, "the worker's span")
    finally:
        relay.stop()
        target.close()
    # Then the Redis worker's process span is the child of the send span made in the request
    # (the relay, sending outside any span, kept the message's context and made no span)
    spans = [span_record(s) for s in exporter.get_finished_spans()]
    (sent,) = [s for s in spans if s["kind"] == "PRODUCER"]
    (process,) = [s for s in spans if s["kind"] == "CONSUMER"]
    assert sent["parent_id"] == f"{request.get_span_context().span_id:016x}"
    assert (process["trace_id"], process["parent_id"]) == (sent["trace_id"], sent["span_id"])
    assert process["attributes"]["messaging.message.id"] == message.message_id
    assert (sent["attributes"]["messaging.system"], process["attributes"]["messaging.system"]) == (
        "dramatiq_pg_outbox",
        "dramatiq",
    )


# -- the guide's snippet ----------------------------------------------------------------------------


def _console_spans(text: str) -> list[dict[str, Any]]:
    """The spans printed by OpenTelemetry's ConsoleSpanExporter: indented JSON objects from a
    line "{" to a line "}", among the worker's log lines."""
    spans, lines = [], None
    for line in text.splitlines():
        if line == "{":
            lines = [line]
        elif lines is not None:
            lines.append(line)
            if line == "}":
                spans.append(json.loads("\n".join(lines)))
                lines = None
    return spans


def test_the_guide_snippet_continues_the_sign_up_trace_in_the_worker(
    database_url: str, db: Any, tmp_path: Path
) -> None:
    # Given the tracing guide's tasks.py, with the test database's URLs
    guide = (ROOT / "docs" / "guides" / "tracing.md").read_text()
    code = guide.split("```python\n", 1)[1].split("```", 1)[0]
    sa_url = normalize_sqlalchemy_url(database_url).render_as_string(hide_password=False)
    code = code.replace("postgresql+psycopg://app@db/app", sa_url).replace(
        "postgresql://app@db/app", database_url
    )
    (tmp_path / "tasks.py").write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # When `python tasks.py` sends, and `dramatiq tasks` runs the message (the CLI passes its
    # workers' output to its stderr)
    sender = subprocess.run(
        [sys.executable, "tasks.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert sender.returncode == 0, sender.stderr
    out = tmp_path / "worker.out"
    with open(out, "w") as stdout:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "tasks", "--processes", "1", "--threads", "1"],
            cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: '"render e-mail"' in out.read_text(), 30, "the actor's span")
    finally:
        worker.terminate()
        worker.wait(30)
    # Then the worker's spans continue the request's trace: request > send > process > render
    request, send = sorted(_console_spans(sender.stdout), key=lambda s: s["kind"] != "SpanKind.INTERNAL")
    assert (request["name"], send["name"], send["kind"]) == (
        "POST /sign-up",
        "send default",
        "SpanKind.PRODUCER",
    )
    spans = {s["name"]: s for s in _console_spans(out.read_text())}
    process, render = spans["process default"], spans["render e-mail"]
    assert process["kind"] == "SpanKind.CONSUMER"
    assert process["attributes"][DELIVERY_COUNT] == 1
    chain = [request, send, process, render]
    assert {s["context"]["trace_id"] for s in chain} == {request["context"]["trace_id"]}
    assert [s["parent_id"] for s in chain[1:]] == [s["context"]["span_id"] for s in chain[:-1]]


# -- metrics ----------------------------------------------------------------------------------------


def test_messages_are_counted_when_stored_and_deliveries_timed_by_outcome(
    make_broker: Any, start_worker: Any, database_url: str
) -> None:
    # Given the middleware with a meter provider of its own, and an actor that fails on "boom"
    reader = InMemoryMetricReader()
    broker = make_broker()
    broker.add_middleware(TracingMiddleware(meter_provider=MeterProvider(metric_readers=[reader])))

    @dramatiq.actor(broker=broker, max_retries=0)
    def work(key: str) -> None:
        if key == "boom":
            raise RuntimeError(key)

    # When three messages commit with their transaction, one is rolled back, one is sent on the pool
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    with Session(engine) as session:
        with outbox(session):
            for key in ("a", "b", "c"):
                work.send(key)
        session.commit()
    with Session(engine) as session:
        with outbox(session):
            work.send("rolled back")
        session.rollback()
    engine.dispose()
    work.send("boom")
    start_worker(broker)
    broker.join("default", timeout=30_000)
    # Then 4 were sent (the rolled-back one never was), 4 consumed, and 4 deliveries timed,
    # the failed one under its error.type
    points = {
        metric.name: metric.data.data_points
        for resource in reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    common = {"messaging.system": "dramatiq_pg_outbox", "messaging.destination.name": "default"}
    ((sent,),) = [points["messaging.client.sent.messages"]]
    assert (sent.value, dict(sent.attributes)) == (4, {**common, "messaging.operation.name": "send"})
    ((consumed,),) = [points["messaging.client.consumed.messages"]]
    assert (consumed.value, dict(consumed.attributes)) == (
        4,
        {**common, "messaging.operation.name": "process"},
    )
    durations = {p.attributes.get("error.type"): p.count for p in points["messaging.process.duration"]}
    assert durations == {None: 3, "RuntimeError": 1}
