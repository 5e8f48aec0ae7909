"""PostgresBroker: Dramatiq on a PostgreSQL table.

Storage layout: see ``alembic/versions/0001_initial.py``; every statement is in
``queries.sql``.  Design notes (the four loops, lease fencing, liveness-based
rescue) are in docs/design.md and in the ``_runtime`` package.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import psycopg
from dramatiq import Actor, Message
from dramatiq.broker import Broker, Consumer, MessageProxy
from dramatiq.common import dq_name, q_name, xq_name
from dramatiq.errors import QueueJoinTimeout, QueueNotFound
from dramatiq.middleware import GroupCallbacks, Middleware, MiddlewareError
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL, Engine

from .._binding import current_binding
from .._isolation import connect
from .._queries import CHANGED_ROWS_ROUNDS
from .._runtime import ProcessRuntime, StoredMessage
from ..errors import Canceled, MessageTooLarge, describe_rejection, libpq_detail
from ..names import DEFAULT_SCHEMA, channel_for, validate_queue_name, validate_schema_name
from ..options import (
    CHECK_SCHEMA,
    FLUSH_BATCH_SIZE,
    FLUSH_INTERVAL_MS,
    HEARTBEAT_INTERVAL_MS,
    HEARTBEAT_TIMEOUT_MS,
    LISTEN,
    MAX_DELIVERIES,
    MAX_FETCH_INTERVAL_MS,
    MAX_LEASE_MS,
    MAX_MESSAGE_BYTES,
    MIN_FETCH_INTERVAL_MS,
    NOTIFY,
    OPTION_NAMES,
    OVERFETCH_FACTOR,
    POOL_SIZE,
    POOL_TIMEOUT_MS,
    PREPARE_THRESHOLD,
    RESCUE_INTERVAL_MS,
    ROTATE_INTERVAL_MS,
    BrokerOptions,
    NotifyMode,
    options_docstring,
)
from ..urls import libpq_url, parse_url, percent_encode, safe_url
from .concurrency import ConcurrencyKeys, apply_actor_options
from .consumer import (
    CANCEL_MODES,
    PostgresConsumer,
    PostgresMessage,
    begin_deciding,
    deciding,
    end_deciding,
    running_message,
)

#: Signals whose middleware hooks run while a delivery's outcome is decided:
#: what they enqueue or store is written with the ack or nack (see PostgresBroker.emit_after).
FOLLOW_UP_SIGNALS = frozenset({"process_message", "skip_message", "ack", "nack"})


class _Option:
    """A read-only attribute of the broker that reads the option of the same name in ``broker.options``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, broker: PostgresBroker | None, owner: type | None = None) -> Any:
        if broker is None:
            return self
        return getattr(broker.options, self.name)


class PostgresBroker(Broker):
    """A Dramatiq broker whose queues are rows of a PostgreSQL table.

    ``actor.send()`` inside :func:`~dramatiq_pg_outbox.outbox` writes the
    message through a SQLAlchemy session's own transaction; elsewhere it uses
    this broker's pool.  Connections are opened lazily, on first use in each
    process, never at construction (the ``dramatiq`` CLI forks workers).

    Parameters:
      url(str): PostgreSQL URL (``postgresql://`` or a SQLAlchemy URL such as
        ``postgresql+psycopg://``).  Exactly one of ``url`` and ``engine``.
        Its password (also a ``?password=`` parameter) is masked in ``repr``,
        logs and errors.
      engine(sqlalchemy.engine.Engine): Take the URL of this engine.
      schema(str): Schema of the tables.  Default ``dramatiq``.  The NOTIFY
        channel is ``dramatiq_pg_outbox.<schema>``; for schema names over 44
        characters it is ``dramatiq_pg_outbox.<first 27 characters>.<16 hex digits
        of the name's SHA-256>``, to fit PostgreSQL's 63-byte limit.
      middleware(list[Middleware]): As for :class:`dramatiq.Broker`.

    Actors of this broker take one more option, ``cancel`` (str): what an operator's
    cancel of a running message does (``dramatiq-pg-outbox cancel``, the dashboard's
    Cancel).  ``"interrupt"`` (the default) raises
    :class:`~dramatiq_pg_outbox.errors.Canceled` in the actor's thread, as Dramatiq's
    ``TimeLimit`` does; ``"ask"`` never interrupts: the actor polls
    :func:`~dramatiq_pg_outbox.is_canceled` and returns.  Either way the delivery ends
    in history as ``canceled``, with no retry and no follow-ups.

    The other keyword arguments are the tuning options, the fields of
    :class:`~dramatiq_pg_outbox.options.BrokerOptions` where each is written
    once; each is also a read-only attribute (``broker.pool_size``).  Their
    defaults, units and rules: the table of the Configuration guide
    (docs/guides/configuration.md), generated from them, or "Other Parameters"
    in ``help(PostgresBroker)``.  Times are integers (``int``, not ``float`` or
    ``bool``), as everywhere in Dramatiq.  All options are checked at
    construction, before any connection.

    Raises:
      ValueError: For a bad schema name, a non-PostgreSQL URL, or an option of
        the wrong type or out of its range; the message names the option, the
        value and the rule.
    """

    def __init__(
        self,
        *,
        url: str | URL | None = None,
        engine: Engine | None = None,
        schema: str = DEFAULT_SCHEMA,
        middleware: list[Middleware] | None = None,
        pool_size: int = POOL_SIZE,
        pool_timeout: int = POOL_TIMEOUT_MS,
        max_deliveries: int = MAX_DELIVERIES,
        overfetch_factor: float = OVERFETCH_FACTOR,
        min_fetch_interval: int = MIN_FETCH_INTERVAL_MS,
        max_fetch_interval: int = MAX_FETCH_INTERVAL_MS,
        flush_interval: int = FLUSH_INTERVAL_MS,
        max_flush_delay: int | None = None,
        flush_batch_size: int = FLUSH_BATCH_SIZE,
        heartbeat_interval: int = HEARTBEAT_INTERVAL_MS,
        heartbeat_timeout: int = HEARTBEAT_TIMEOUT_MS,
        rescue_interval: int = RESCUE_INTERVAL_MS,
        rotate_interval: int = ROTATE_INTERVAL_MS,
        max_lease: int | None = MAX_LEASE_MS,
        notify: NotifyMode = NOTIFY,
        listen: bool = LISTEN,
        check_schema: bool = CHECK_SCHEMA,
        prepare_threshold: int | None = PREPARE_THRESHOLD,
        max_message_bytes: int | None = MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(middleware=middleware)
        if not any(isinstance(m, ConcurrencyKeys) for m in self.middleware):
            self.add_middleware(ConcurrencyKeys())
        # The option of a running message's cancel (see emit_before): no middleware declares it.
        self.actor_options.add("cancel")
        #: The worker-side instruments of :class:`~dramatiq_pg_outbox.metrics.WorkerMetrics`, if added.
        self._metrics: Any = None
        if (url is None) == (engine is None):
            raise ValueError("Pass exactly one of url= and engine=.")
        parsed = engine.url if engine is not None else parse_url(url) if url is not None else None
        assert parsed is not None
        self.conninfo = libpq_url(parsed)
        #: The URL with its password masked (also a ``?password=`` query parameter): for logs and errors.
        self.safe_url = safe_url(parsed)
        _check_libpq_url(self.conninfo, self.safe_url, parsed.password)
        self.schema = validate_schema_name(schema)
        #: LISTEN/NOTIFY channel: ``dramatiq_pg_outbox.<schema>``, shortened for long schemas.
        self.channel = channel_for(schema)
        # The option arguments, by name (the signature's list is checked against the fields by
        # tests/test_options_doc.py).
        given = locals()
        options = BrokerOptions(**{name: given[name] for name in OPTION_NAMES})
        #: The validated tuning options (also readable as attributes: ``broker.max_fetch_interval``).
        self.options = options
        self.queues: set[str] = set()
        self._runtime: ProcessRuntime | None = None
        self._runtime_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<PostgresBroker {self.safe_url} schema={self.schema!r}>"

    @property
    def runtime(self) -> ProcessRuntime:
        """This process's pool and background loops, created on first use (again after a fork)."""
        runtime = self._runtime
        if runtime is None or runtime.pid != os.getpid() or runtime.closed:
            with self._runtime_lock:
                runtime = self._runtime
                if runtime is None or runtime.pid != os.getpid() or runtime.closed:
                    runtime = self._runtime = ProcessRuntime(self)
        return runtime

    @property
    def has_runtime(self) -> bool:
        """True while this process has the broker's runtime open (its pool and loops).

        A broker opens it on first use (a consumer, a send outside an outbox) and
        :meth:`close` closes it; a send inside an ``outbox()`` never opens it.
        """
        runtime = self._runtime
        return runtime is not None and runtime.pid == os.getpid() and not runtime.closed

    def close(self) -> None:
        """Flush buffered acks, hand back unstarted messages, unregister this worker, close connections."""
        runtime = self._runtime
        if runtime is not None and runtime.pid == os.getpid():
            for group in list(runtime.consumers.values()):
                for consumer in list(group):
                    consumer.close()
            runtime.close()
        self._runtime = None

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30_000) -> Consumer:
        """Create a consumer of one queue.

        Parameters:
          queue_name(str): A declared queue or delay queue.
          prefetch(int): Most unacknowledged messages (times ``overfetch_factor``).
          timeout(int): Longest block of ``__next__`` before it returns None, in milliseconds.

        Raises:
          QueueNotFound: If the queue was never declared.
        """
        validate_queue_name(queue_name)
        if queue_name not in self.queues and queue_name not in self.delay_queues:
            raise QueueNotFound(queue_name)
        return PostgresConsumer(self, queue_name, prefetch, timeout)

    def declare_queue(self, queue_name: str) -> None:
        """Declare a queue (and its delay queue).  Idempotent; stores the canonical name.

        Raises:
          ValueError: If the name is invalid.
        """
        validate_queue_name(queue_name)
        queue_name = q_name(queue_name)
        if queue_name not in self.queues:
            self.emit_before("declare_queue", queue_name)
            self.queues.add(queue_name)
            self.emit_after("declare_queue", queue_name)
            delayed_name = dq_name(queue_name)
            self.delay_queues.add(delayed_name)
            self.emit_after("declare_delay_queue", delayed_name)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Store a message; inside :func:`outbox` it joins the bound transaction.

        A delayed message is stored on its own queue with ``next_attempt_at =
        now() + delay`` and is claimed only once due: it is never held in a
        worker's memory, and no ``eta`` option or ``.DQ`` queue is involved.

        Parameters:
          message(Message): The message (or a MessageProxy).
          delay(int): Minimum delay before delivery, in milliseconds.

        Raises:
          ValueError: If the queue name is invalid or the delay negative.
          ConnectionClosed/ConnectionFailed: If the database cannot be reached.
          SchemaNotReady: If the tables are missing or old.

        Returns:
          Message: The stored message.
        """
        return self.enqueue_many([message], delay=delay)[0]

    def enqueue_many(
        self, messages: Iterable[Message[Any]], *, delay: int | None = None, batch_size: int = 5_000
    ) -> list[Message[Any]]:
        """Store many messages with one multi-row INSERT per ``batch_size`` (a fan-out).

        Each message is encoded here, at send time: an encoding error is raised
        by this call and nothing of it is stored.  Inside :func:`outbox` the
        messages join the bound transaction like ``send()`` (written as one
        statement just before it commits, whatever ``batch_size``); otherwise
        each batch is one statement (and one commit) on the pool.  Middleware
        sees ``before_enqueue`` for every message now, and ``after_enqueue``
        for every message actually stored (not for idempotency duplicates):
        at once on the pool, after the commit inside :func:`outbox`.

        Parameters:
          messages(Iterable[Message]): e.g. ``[actor.message(x) for x in xs]``.
          delay(int): Minimum delay before delivery of each, in milliseconds.
          batch_size(int): Messages per statement outside a binding.  Default 5000.

        Raises:
          ValueError: For an invalid queue name, a negative delay or a batch_size below 1
            (before any write).
          MessageTooLarge: For a message over ``max_message_bytes`` (before any write; a
            follow-up over it instead quarantines the message whose hooks sent it).
          TypeError: For an argument the encoder cannot encode (naming the actor and
            the argument; before any write).
          ConnectionClosed/ConnectionFailed: If the database cannot be reached (outside a binding).
          SchemaNotReady: If the tables are missing or old (outside a binding).

        Returns:
          list[Message]: The messages, in their stored form.
        """
        if delay is not None and delay < 0:
            raise ValueError(f"delay must be a non-negative number of milliseconds, not {delay!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size!r}")
        prepared = [_stored_form(message) for message in messages]
        delay_ms = int(delay or 0)
        finishing = deciding()
        if finishing is not None and finishing.consumer.broker is not self:
            finishing = None  # a message of another broker: this send is not its follow-up
        binding = current_binding(self) if finishing is None else None
        limit = self.options.max_message_bytes
        for start in range(0, len(prepared), batch_size):
            batch = prepared[start : start + batch_size]
            self.logger.debug("Enqueueing %d message(s), first %r.", len(batch), batch[0].message_id)
            stored = []
            for message in batch:
                self.emit_before("enqueue", message, delay)
                apply_actor_options(self, message)
                try:
                    stored.append(StoredMessage.of(message, delay_ms, limit))
                except MessageTooLarge as e:
                    if finishing is None:
                        raise
                    # A follow-up over the limit: raising here would only be logged by
                    # Dramatiq's emit_after, and the delivery acked without it.  Its
                    # message is quarantined instead, none of its follow-ups written.
                    finishing.refused.append(str(e))
                    self.logger.error("A follow-up of message %d is refused: %s", finishing.row_id, e)
            if finishing is not None:
                # A follow-up: written with the ack or nack (see emit_after); after_enqueue
                # runs once that transaction has committed.
                finishing.sending_to.extend(stored)
            elif binding is not None:
                binding.add(self, stored)
                if self.options.notify == "after_commit":
                    # The commit writes its NOTIFY on the notifier's connection (else the flush
                    # thread sends it): have both ready by then.
                    self.runtime.flusher.start_ahead()
            else:
                for item in self.runtime.enqueue(stored, notify=self.options.notify != "off"):
                    self.emit_after("enqueue", item.message, item.delay or None)
        return prepared

    def add_middleware(
        self,
        middleware: Middleware,
        *,
        before: type[Middleware] | None = None,
        after: type[Middleware] | None = None,
    ) -> None:
        """Add a middleware (Dramatiq's ``Broker.add_middleware``).

        Dramatiq's ``GroupCallbacks`` on a :class:`~dramatiq_pg_outbox.rate_limits.PostgresBackend`
        of this broker's database is added in the form that writes a member's
        barrier count-down and the group's completion callbacks with the member's
        ack, in one transaction (exactly once: see docs/guarantees.md).

        Raises:
          ValueError: When ``before`` or ``after`` names a middleware not added yet.
        """
        backend = getattr(middleware, "rate_limiter_backend", None)
        joined = getattr(backend, "joined_group_callbacks", None)
        if type(middleware) is GroupCallbacks and joined is not None:
            middleware = joined(middleware, self)
        super().add_middleware(middleware, before=before, after=after)

    def declare_actor(self, actor: Actor[Any, Any]) -> None:
        """Declare an actor (Dramatiq's ``Broker.declare_actor``), checking its ``cancel`` option.

        Raises:
          ValueError: When ``cancel`` is not ``"interrupt"`` or ``"ask"``.
        """
        mode = actor.options.get("cancel", "interrupt")
        if mode not in CANCEL_MODES:
            raise ValueError(
                f"actor {actor.actor_name!r}: cancel={mode!r} is not an option; "
                'use cancel="interrupt" (the default) or cancel="ask"'
            )
        super().declare_actor(actor)

    #: The middleware list that _hooks_by_name was found for (None: not yet; see _hooks).
    _hooks_of: list[Middleware] | None = None
    _hooks_by_name: dict[str, tuple[tuple[Middleware, Any], ...]]

    def _hooks(self, name: str) -> tuple[tuple[Middleware, Any], ...]:
        """The middleware whose hook ``name`` (``before_ack``, ...) is not Dramatiq's no-op, in list order.

        Dramatiq's ``Broker.emit_before``/``emit_after`` look every hook up on every
        middleware at every signal: about 56 ``getattr`` and 24 calls of
        ``Middleware``'s empty hooks per message with the default middleware
        (``python -m benchmarks.calls_per_message --top 20``).  The hooks that do
        something are found once per middleware list and kept until the list changes
        (compared by identity of its items at each signal: one C-level list comparison);
        a hook assigned on a middleware instance counts as overriding.
        """
        if self._hooks_of != self.middleware:
            self._hooks_of = list(self.middleware)
            self._hooks_by_name = {}
        hooks = self._hooks_by_name.get(name)
        if hooks is None:
            default = getattr(Middleware, name, None)
            found = []
            for middleware in self._hooks_of:
                hook = getattr(middleware, name)
                if default is None or getattr(hook, "__func__", None) is not default:
                    found.append((middleware, hook))
            hooks = self._hooks_by_name[name] = tuple(found)
        return hooks

    def _emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``Broker.emit_before`` over the hooks that do something (see _hooks)."""
        name = "before_" + signal
        for middleware, hook in self._hooks(name):
            try:
                hook(self, *args, **kwargs)
            except MiddlewareError:
                raise
            except Exception:
                self.logger.critical("Unexpected failure in %s of %r.", name, middleware, exc_info=True)

    def _emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``Broker.emit_after`` (reverse order) over the hooks that do something (see _hooks)."""
        name = "after_" + signal
        for middleware, hook in reversed(self._hooks(name)):
            try:
                hook(self, *args, **kwargs)
            except Exception:
                self.logger.critical("Unexpected failure in %s of %r.", name, middleware, exc_info=True)

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        # Dramatiq's worker calls emit_before("ack"/"nack"), then Consumer.ack/nack, then
        # emit_after: the decision waits for emit_after, so what after_ack/after_nack
        # hooks store (Results stores a failure in after_nack) is written with it.
        if signal in ("ack", "nack") and args and isinstance(args[0], PostgresMessage):
            args[0].deferred = True
        self._emit_before(signal, *args, **kwargs)
        if signal == "process_message" and args and isinstance(args[0], PostgresMessage):
            # Running, not prefetched any more: the heartbeat tells the dashboard, and a
            # cancel interrupts this thread (or, for cancel="ask", is_canceled() tells the actor).
            message = args[0]
            actor = self.actors.get(message.actor_name)
            mode = "interrupt" if actor is None else actor.options.get("cancel", "interrupt")
            running_message(message)
            self.runtime.started(message.row_id, message, interrupt=mode == "interrupt")

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Run the ``after_<signal>`` hooks; for a delivery's outcome, collect what they send.

        While the ``after_process_message``, ``after_skip_message``,
        ``after_ack`` and ``after_nack`` hooks of a message claimed from this
        broker run, ``enqueue`` (Retries' retry, Pipelines' next step,
        Callbacks, GroupCallbacks' completion) and
        :class:`~dramatiq_pg_outbox.results.PostgresBackend` stores on the same
        database do not write: they join the message's ack or nack, which the
        flusher writes with them in one transaction fenced by the message's
        lease.  This wraps every hook, whatever its place in the middleware
        list (Dramatiq runs ``after_*`` hooks in reverse order, so a marker
        middleware could not see them all).  Sends from the actor's own body
        are written at once.
        """
        if signal == "process_boot":
            self._emit_after(signal, *args, **kwargs)
            self._refuse_to_boot_if_rejected()
            return
        message = args[0] if args else None
        if (
            signal not in FOLLOW_UP_SIGNALS
            or not isinstance(message, PostgresMessage)
            or message.consumer.broker is not self
        ):
            self._emit_after(signal, *args, **kwargs)
            return
        if signal in ("process_message", "skip_message"):
            self.runtime.finished(message.row_id)
            running_message(None)
            if message.cancel_requested:
                kwargs = self._canceled(message, signal, kwargs)
        previous = begin_deciding(message)
        try:
            self._emit_after(signal, *args, **kwargs)
        finally:
            end_deciding(previous)
        if signal in ("ack", "nack") and message.deferred:
            message.deferred = False
            if message.outcome is not None:
                message.consumer.submit(message)

    @staticmethod
    def _canceled(message: PostgresMessage, signal: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The hooks' keywords for a delivery an operator canceled: it failed with ``Canceled``.

        The hooks see an exception (no result stored, no pipeline step) and the worker
        nacks it (a result waiter gets the failure); the consumer decides it as canceled
        and drops the messages the hooks sent (Retries' retry, Callbacks' on_failure).
        """
        message.fail()
        if signal != "process_message":
            return kwargs
        exception = kwargs.get("exception")
        if exception is None:
            # cancel="ask": the actor returned on its own.
            exception = Canceled("its actor returned after the cancel")
            message.stuff_exception(exception)
        return {"exception": exception}

    def _refuse_to_boot_if_rejected(self) -> None:
        """In a ``dramatiq`` worker process at boot: exit at once if PostgreSQL refuses us for good.

        One connection attempt.  A wrong password, a missing role or database
        or no ``pg_hba.conf`` entry logs one line and exits with Dramatiq's
        ``RET_CONNECT`` (3), which stops the whole ``dramatiq`` command; a
        transient failure (server down or starting) logs a warning and the
        worker starts, waiting for the server as usual.

        Raises:
          SystemExit: With code 3, on a refusal that retrying cannot fix.
        """
        kwargs: dict[str, Any] = {"autocommit": True, "application_name": f"dramatiq-pg-outbox:{os.getpid()}"}
        if not conninfo_to_dict(self.conninfo).get("connect_timeout"):
            kwargs["connect_timeout"] = 10
        try:
            connect(self.conninfo, **kwargs).close()
        except psycopg.OperationalError as e:
            reason = describe_rejection(e, self.conninfo)
            if reason is None:
                self.logger.warning(
                    "PostgreSQL is not reachable yet, the worker keeps trying: %s", libpq_detail(e)
                )
                return
            self.logger.critical("%s", reason)
            raise SystemExit(3) from None

    def get_declared_queues(self) -> set[str]:
        return self.queues.copy()

    def flush(self, queue_name: str) -> None:
        """Drop every stored message of a queue and its delay queue (history is kept)."""
        queue_name = q_name(validate_queue_name(queue_name))
        queue_names = [queue_name, dq_name(queue_name), xq_name(queue_name)]
        ids: list[int] | None = None
        for _ in range(CHANGED_ROWS_ROUNDS):
            # Again for the rows the statement saw but did not delete (moved by the reclaimer).
            with self.runtime.connection() as conn:
                ids = self.runtime.store.purge(conn, queue_names=queue_names, ids=ids)
            if not ids:
                return

    def flush_all(self) -> None:
        """Drop every stored message of every declared queue."""
        for queue_name in self.queues:
            self.flush(queue_name)

    def join(self, queue_name: str, *, interval: int = 100, timeout: int | None = None) -> None:
        """Wait until a queue has no pending, delayed or in-flight message (tests).

        Parameters:
          queue_name(str): The queue.
          interval(int): Poll interval, in milliseconds.  Default 100.
          timeout(int|None): Longest wait, in milliseconds.  Default None (forever).

        Raises:
          QueueJoinTimeout: When the timeout elapses first.
        """
        queue_name = q_name(validate_queue_name(queue_name))
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            if self.queue_size(queue_name) == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)

    def queue_size(self, queue_name: str) -> int:
        """Stored messages of a queue and its delay queue, in one snapshot (unflushed acks count)."""
        queue_name = q_name(validate_queue_name(queue_name))
        with self.runtime.connection() as conn:
            return self.runtime.store.queue_size(conn, queue_names=[queue_name, dq_name(queue_name)])


# Each option of BrokerOptions is a read-only attribute of the broker, and an "Other Parameters"
# entry of its docstring.
for _name in OPTION_NAMES:
    setattr(PostgresBroker, _name, _Option(_name))
del _name
PostgresBroker.__doc__ = (
    f"{(PostgresBroker.__doc__ or '').rstrip()}\n\n    Other Parameters:\n{options_docstring()}"
)


def _check_libpq_url(conninfo: str, shown: str, password: Any) -> None:
    """Refuse at construction a URL that libpq would refuse at every connection attempt.

    Raises:
      ValueError: Naming the parameter libpq does not know (``?prepare_threshold=`` is an
        option of the broker, not of the URL), never the password (as given or percent-encoded).
    """
    try:
        conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        detail = libpq_detail(e)
        if password and any(form in detail for form in (str(password), percent_encode(str(password)))):
            detail = "its syntax is wrong"
        hint = ""
        if "prepare_threshold" in detail:
            hint = " It is an option of the broker: PostgresBroker(url=..., prepare_threshold=None)."
        raise ValueError(f"libpq refuses the URL {shown}: {detail}.{hint}") from None


def _stored_form(message: Message[Any] | MessageProxy) -> Message[Any]:
    """The message as stored: unwrapped, on its canonical queue, without Dramatiq's ``eta``.

    Raises:
      ValueError: If the queue name is invalid.
    """
    if isinstance(message, MessageProxy):
        message = message._message
    queue_name = q_name(validate_queue_name(message.queue_name))
    if queue_name != message.queue_name or "eta" in message.options:
        options = {k: v for k, v in message.options.items() if k != "eta"}
        message = dataclasses.replace(message, queue_name=queue_name, options=options)
    return message


def broker_for_backend(
    *,
    url: str | URL | None,
    engine: Engine | None,
    broker: PostgresBroker | None,
    schema: str | None,
    pool_size: int,
    pool_timeout: int,
    tables: str,
) -> tuple[PostgresBroker, bool]:
    """The broker a backend (results, rate limits) runs its statements through: (broker, owned).

    With ``broker=``, that broker (its database, schema and pool; not owned).  With
    ``url=``/``engine=``, a private broker that never consumes: a lazy, fork-aware
    pool with the broker's error translation and schema check (owned: the backend
    closes it).

    Parameters:
      tables(str): What lives beside the broker's tables, for the schema error
        (``"the results table lives"``).

    Raises:
      ValueError: If not exactly one of ``url``, ``engine``, ``broker`` is given, or
        ``schema`` differs from the broker's.
      TypeError: If ``broker`` is not a :class:`PostgresBroker`.
    """
    if sum(x is not None for x in (url, engine, broker)) != 1:
        raise ValueError("Pass exactly one of url=, engine= and broker=.")
    if broker is None:
        private = PostgresBroker(
            url=url,
            engine=engine,
            schema=schema or DEFAULT_SCHEMA,
            middleware=[],
            pool_size=pool_size,
            pool_timeout=pool_timeout,
            listen=False,
        )
        return private, True
    if not isinstance(broker, PostgresBroker):
        raise TypeError(f"broker must be a PostgresBroker, not {type(broker).__name__}")
    if schema is not None and schema != broker.schema:
        raise ValueError(
            f"schema={schema!r} differs from the broker's schema {broker.schema!r}: "
            f"{tables} beside the broker's tables."
        )
    return broker, False
