"""OpenTelemetry traces: one trace from the code that sends a message to the actor that runs it.

Why: a message sent by a web request, inside the request's own transaction
(:func:`~dramatiq_pg_outbox.outbox`), runs later in another process.  Without
trace context in the message, the actor's spans start a trace of their own and
nobody can tell which request caused them.

Usage (extra ``otel``: ``pip install 'dramatiq-pg-outbox[otel]'``, which brings
``opentelemetry-api`` only; configure the SDK and an exporter in the application and
in the worker module as for any other instrumentation)::

    from dramatiq_pg_outbox.tracing import TracingMiddleware

    broker = PostgresBroker(url=...)
    broker.add_middleware(TracingMiddleware())

The same middleware on the producing side (the web application's broker) and
on the consuming side (the module the ``dramatiq`` CLI imports); usually that
is the same module.

What it records, after the OpenTelemetry semantic conventions for messaging
spans (semantic conventions 1.44, status "development": ``send``/``process``
operation types, which replaced ``publish``/``deliver``):

* ``send <queue>``, kind PRODUCER, for every message enqueued through the broker
  (``send()``, ``send_with_options()``, ``enqueue_many()``, inside or outside
  ``outbox()``, and the follow-ups that Dramatiq's middleware send: a retry,
  a pipeline's next step, a callback).  It is started and ended in
  ``before_enqueue``: its context, a child of the caller's current span, is the
  message's creation context, injected with the globally configured propagator
  (W3C ``traceparent``/``tracestate`` and baggage by default) into the message
  option ``trace_context``, before the message is encoded, so the stored message
  carries it; a message sent outside any span that already carries a context (a
  forwarded one) keeps it, with no span.  It does not time the write: inside ``outbox()`` nothing is written
  until the application commits (its database instrumentation times the commit),
  a follow-up is written with the ack of the message being finished, and a
  ``send()`` on the pool writes at once.  ``dramatiq_pg_outbox.enqueue.path``
  says which of the three (``"outbox"``, ``"follow_up"``, ``"pool"``).
* ``process <queue>``, kind CONSUMER, around each delivery on a worker thread:
  from ``before_process_message`` to the ack or nack (so the middleware's
  follow-ups, such as a retry, are sent within it), the creation context as its
  parent and as a link (the conventions ask for the link; the parent makes the
  actor's own spans part of the sender's trace).  It is the current span while
  the actor runs.  An actor that raised gets status ERROR, ``error.type`` (the
  exception's class name) and an exception event; a nack (dead letter) sets
  ``dramatiq_pg_outbox.message.dead_lettered``.

Attributes of both: ``messaging.system`` (``"dramatiq_pg_outbox"``: the
conventions list no value for this broker and allow a custom one; ``"rabbitmq"``
or ``"dramatiq"`` when the middleware is on Dramatiq's RabbitMQ or another broker,
a relay's target, say),
``messaging.operation.type`` and ``messaging.operation.name`` (``"send"`` or
``"process"``), ``messaging.destination.name`` (the queue), ``messaging.message.id``
(Dramatiq's message id; a retry keeps it), ``dramatiq_pg_outbox.actor.name``.
``process`` spans add ``dramatiq_pg_outbox.message.delivery_count``: the
broker's count of claims of the stored message, this one included, charged
before the actor runs (1 on a first delivery; more after a worker died holding
it; the conventions have no generic attribute for it, so it is namespaced by
this project).  Dramatiq's retries are new messages: each counts from 1.

Metrics, the conventions' messaging metrics through the meter provider (each with
``messaging.system``, ``messaging.operation.name`` and ``messaging.destination.name``):
``messaging.client.sent.messages`` (counter, ``{message}``) counts a message once it is
stored: at once on the pool, at the commit of its ``outbox()`` transaction (never
if it rolls back), with the ack for a follow-up; an idempotency duplicate is not
counted.  ``messaging.client.consumed.messages`` (counter) counts deliveries handed
to an actor, and ``messaging.process.duration`` (histogram, seconds, the
conventions' buckets) times each from its first middleware hook to its ack or
nack, with ``error.type`` when the actor raised.

Cost: nothing unless the middleware is added.  Added without a configured SDK,
OpenTelemetry's API hands out non-recording spans: no option is stored, no
context is attached on the worker thread, and the hooks took about 2
microseconds per send and 6 per delivery (Python 3.11, measured with Dramatiq's
StubBroker on a busy 2-core machine).  No span is made for claims or
flushes: they are batched (one claim serves many messages, and an idle
consumer claims every ``max_fetch_interval``), so per-claim spans would be noise
in every trace; :class:`~dramatiq_pg_outbox.metrics.WorkerMetrics` has their
durations as histograms.

Why not ``opentelemetry-instrumentor-dramatiq`` (0.1.4): it patches
``Actor.message_with_options`` and ``dramatiq.worker._WorkerThread.process_message``
(a private class), makes a SERVER span around building the message rather than
a PRODUCER span around sending it, nests every option of the message under
``options["options"]`` (so ``max_retries``, ``on_success`` or
``idempotency_key`` given to ``send_with_options`` no longer reach the
middleware or the broker), attaches the extracted context on the worker thread
without ever detaching it, and sets no ``messaging.*`` attribute nor any
delivery count.  A middleware uses Dramatiq's public hooks only.
"""

from __future__ import annotations

import importlib.metadata
import threading
import time
from collections.abc import Mapping
from contextvars import Token
from typing import TYPE_CHECKING, Any

from dramatiq.middleware import Middleware

from ._binding import current_binding
from .broker import PostgresBroker
from .broker.consumer import PostgresMessage, deciding
from .errors import OutboxError

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, propagate, trace
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "dramatiq_pg_outbox.tracing needs opentelemetry-api: pip install 'dramatiq-pg-outbox[otel]'"
    ) from e

if TYPE_CHECKING:
    from dramatiq import Broker, Message
    from dramatiq.broker import MessageProxy
    from opentelemetry.context import Context
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span, Tracer, TracerProvider

#: The message option that carries the creation context: the propagator's fields
#: (``traceparent``, ``tracestate``, ``baggage``), a ``dict[str, str]``.
OPTION = "trace_context"
#: ``messaging.system`` on a :class:`~dramatiq_pg_outbox.PostgresBroker`: no listed value
#: applies, so a custom one (the package's name).  ``"rabbitmq"`` on Dramatiq's
#: ``RabbitmqBroker`` (a listed value), ``"dramatiq"`` on any other broker.
SYSTEM = "dramatiq_pg_outbox"
#: The delivery count of a ``process`` span (claims of the stored message, this one included).
DELIVERY_COUNT = "dramatiq_pg_outbox.message.delivery_count"
#: How a ``send`` span's message is written: ``"outbox"``, ``"follow_up"`` or ``"pool"``.
ENQUEUE_PATH = "dramatiq_pg_outbox.enqueue.path"
#: Set (True) on a ``process`` span whose message was nacked: dead-lettered.
DEAD_LETTERED = "dramatiq_pg_outbox.message.dead_lettered"
#: The actor's name, on both kinds of span.
ACTOR_NAME = "dramatiq_pg_outbox.actor.name"
#: The schema of the attribute names used (the semantic conventions' version).
SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
#: Bucket boundaries of ``messaging.process.duration``, in seconds (the conventions' advice).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class _Delivery:
    """The message a worker thread is running: its ``process`` span, the context token
    attached for it (None if none was), when it started (``time.monotonic()``, seconds),
    the attributes of its metrics."""

    __slots__ = ("attributes", "message_id", "span", "started", "token")

    def __init__(
        self, message_id: str, span: Span, token: Token[Context] | None, attributes: dict[str, Any]
    ) -> None:
        self.message_id = message_id
        self.span = span
        self.token = token
        self.started = time.monotonic()
        self.attributes = attributes


class TracingMiddleware(Middleware):
    """Dramatiq middleware: W3C trace context through the message, PRODUCER and CONSUMER spans, metrics.

    See the module docstring for the spans, their attributes, the metrics and their cost.
    Add it to the broker of every process that sends or runs messages::

        broker.add_middleware(TracingMiddleware())

    Works with any Dramatiq broker; ``dramatiq_pg_outbox.message.delivery_count``
    and ``dramatiq_pg_outbox.enqueue.path`` need a
    :class:`~dramatiq_pg_outbox.PostgresBroker`.

    Parameters:
      tracer_provider(opentelemetry.trace.TracerProvider|None): Where spans go.
        Default None: the global provider (``opentelemetry.trace.set_tracer_provider``);
        one set after the middleware was made is used too (OpenTelemetry's proxy tracer).
      meter_provider(opentelemetry.metrics.MeterProvider|None): Where metrics go.
        Default None: the global provider (``opentelemetry.metrics.set_meter_provider``),
        likewise.

    Raises:
      ImportError: At import of this module, if ``opentelemetry-api`` is missing
        (``pip install 'dramatiq-pg-outbox[otel]'``).
    """

    def __init__(
        self, *, tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None
    ) -> None:
        version = _version()
        self._tracer: Tracer = trace.get_tracer(
            __name__, version, tracer_provider=tracer_provider, schema_url=SCHEMA_URL
        )
        meter = metrics.get_meter(__name__, version, meter_provider=meter_provider, schema_url=SCHEMA_URL)
        self._sent = meter.create_counter(
            "messaging.client.sent.messages", "{message}", "Messages stored by the broker"
        )
        self._consumed = meter.create_counter(
            "messaging.client.consumed.messages", "{message}", "Deliveries handed to an actor"
        )
        self._process_duration = meter.create_histogram(
            "messaging.process.duration",
            "s",
            "Time from the first middleware hook of a delivery to its ack or nack",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self._local = threading.local()

    # Producer side.

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        """Start and end the ``send`` span; inject its context into ``message.options``.

        Outside any span, a message that already carries a context keeps it and gets no
        span: it is being forwarded (the outbox relay's target broker, a due delayed
        message that Dramatiq's worker re-enqueues on RabbitMQ or Redis), and its creation
        context is the one to continue.
        """
        if OPTION in message.options and not trace.get_current_span().get_span_context().is_valid:
            return
        attributes: dict[str, Any] = {
            "messaging.system": _system(broker),
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": message.queue_name,
            "messaging.message.id": message.message_id,
            ACTOR_NAME: message.actor_name,
        }
        if isinstance(broker, PostgresBroker):
            attributes[ENQUEUE_PATH] = _enqueue_path(broker)
        span = self._tracer.start_span(
            f"send {message.queue_name}", kind=trace.SpanKind.PRODUCER, attributes=attributes
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        span.end()
        if carrier:
            message.options[OPTION] = carrier

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        """Count the message in ``messaging.client.sent.messages``: stored now, or committed with
        its ``outbox()`` transaction or its ack (an idempotency duplicate is not counted)."""
        self._sent.add(
            1,
            {
                "messaging.system": _system(broker),
                "messaging.operation.name": "send",
                "messaging.destination.name": message.queue_name,
            },
        )

    # Consumer side.

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Start the ``process`` span, child of the message's creation context, and make it current."""
        self._end_delivery()  # one left by a delivery whose ack never came (should not happen)
        carrier = message.options.get(OPTION)
        parent = propagate.extract(carrier) if isinstance(carrier, Mapping) else None
        creation = trace.get_current_span(parent).get_span_context() if parent is not None else None
        links = [trace.Link(creation)] if creation is not None and creation.is_valid else None
        attributes: dict[str, Any] = {
            "messaging.system": _system(broker),
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": message.queue_name,
            "messaging.message.id": message.message_id,
            ACTOR_NAME: message.actor_name,
        }
        if isinstance(message, PostgresMessage):
            # Charged by the claim, before any middleware or the actor ran.
            attributes[DELIVERY_COUNT] = message.attempts
        span = self._tracer.start_span(
            f"process {message.queue_name}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
        )
        token = None
        if parent is not None or span.is_recording():
            # (Without an SDK and a context to pass on there is nothing to make current.)
            token = otel_context.attach(trace.set_span_in_context(span, parent))
        metric_attributes = {
            "messaging.system": _system(broker),
            "messaging.operation.name": "process",
            "messaging.destination.name": message.queue_name,
        }
        self._consumed.add(1, metric_attributes)
        self._local.delivery = _Delivery(message.message_id, span, token, metric_attributes)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        """Record the actor's exception, if any, on the ``process`` span (ended at the ack or nack)."""
        delivery = self._delivery(message)
        if delivery is None or exception is None:
            return
        delivery.span.record_exception(exception)
        delivery.span.set_attribute("error.type", type(exception).__qualname__)
        delivery.attributes["error.type"] = type(exception).__qualname__
        delivery.span.set_status(trace.StatusCode.ERROR, f"{type(exception).__qualname__}: {exception}")

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        """Mark the ``process`` span of a message that a middleware skipped (AgeLimit, say)."""
        delivery = self._delivery(message)
        if delivery is not None:
            delivery.span.add_event("message skipped")

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        """End the ``process`` span and restore the thread's context."""
        if self._delivery(message) is not None:
            self._end_delivery()

    def after_nack(self, broker: Broker, message: MessageProxy) -> None:
        """Mark the ``process`` span dead-lettered, end it and restore the thread's context."""
        delivery = self._delivery(message)
        if delivery is not None:
            delivery.span.set_attribute(DEAD_LETTERED, True)
            self._end_delivery()

    def _delivery(self, message: MessageProxy) -> _Delivery | None:
        delivery: _Delivery | None = getattr(self._local, "delivery", None)
        if delivery is None or delivery.message_id != message.message_id:
            return None
        return delivery

    def _end_delivery(self) -> None:
        delivery: _Delivery | None = getattr(self._local, "delivery", None)
        if delivery is None:
            return
        self._local.delivery = None
        self._process_duration.record(time.monotonic() - delivery.started, delivery.attributes)
        delivery.span.end()
        if delivery.token is not None:
            otel_context.detach(delivery.token)


def _system(broker: Broker) -> str:
    """``messaging.system`` for a message of ``broker`` (see :data:`SYSTEM`)."""
    if isinstance(broker, PostgresBroker):
        return SYSTEM
    return "rabbitmq" if type(broker).__name__ == "RabbitmqBroker" else "dramatiq"


def _version() -> str:
    """The installed package's version, for the instrumentation scope ("" if not installed)."""
    try:
        return importlib.metadata.version("dramatiq-pg-outbox")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _enqueue_path(broker: PostgresBroker) -> str:
    """How ``broker.enqueue`` will write a message sent now (mirrors ``PostgresBroker.enqueue_many``)."""
    finishing = deciding()
    if finishing is not None and finishing.consumer.broker is broker:
        return "follow_up"
    try:
        return "outbox" if current_binding(broker) is not None else "pool"
    except OutboxError:
        return "pool"  # enqueue raises this error itself; nothing is written


__all__ = [
    "ACTOR_NAME",
    "DEAD_LETTERED",
    "DELIVERY_COUNT",
    "ENQUEUE_PATH",
    "OPTION",
    "SCHEMA_URL",
    "SYSTEM",
    "TracingMiddleware",
]
