"""The relay's targets: a batch to RabbitMQ (one AMQP transaction) or Redis (one pipeline); their errors."""

from __future__ import annotations

import socket
import uuid
from typing import Any

from dramatiq import Broker, Message
from dramatiq.common import current_millis


class TargetError(Exception):
    """Publishing to the target broker failed (the cause is chained).

    Attributes:
      confirmed(set[int]): Indexes, in the batch, of the messages the target confirmed before
        it failed (archived; the others are released).
    """

    def __init__(self, text: str, confirmed: set[int] | None = None) -> None:
        super().__init__(text)
        self.confirmed = confirmed or set()


class TargetUnusable(Exception):
    """The target broker cannot be used for a reason a retry cannot fix; the text is one line.

    Raised by :func:`check_target` (at start: wrong host, refused connection,
    refused credentials) and by :meth:`Relay.run` when the target refuses the
    credentials later (they were changed): retrying forever would only hide it.
    """


#: Exception class names of pika and redis-py that mean "credentials refused".
_AUTH_ERRORS = frozenset({
    "ProbableAuthenticationError", "AuthenticationError", "ProbableAccessDeniedError",
    "AuthenticationWrongNumberOfArgsError",
})  # fmt: skip


def _chain(error: BaseException | None, most: int = 5) -> list[BaseException]:
    """``error`` and the errors it wraps (``__cause__``, else ``__context__``), at most ``most``."""
    chain: list[BaseException] = []
    while error is not None and len(chain) < most:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def refused_credentials(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it wraps) says the target refused the relay's credentials."""
    return any(
        type(e).__name__ in _AUTH_ERRORS
        or any(word in str(e) for word in ("ACCESS_REFUSED", "WRONGPASS", "NOAUTH"))
        for e in _chain(error)
    )


def check_target(target: Broker, shown: str) -> None:
    """Connect and authenticate to a RabbitMQ or Redis target once (other brokers: nothing to do).

    Parameters:
      target(Broker): The target broker, from :func:`target_broker`.
      shown(str): Its URL with the password masked, for the message.

    Raises:
      TargetUnusable: One line: what failed and what to check in ``--to``.
    """
    kind = type(target).__name__
    try:
        if kind == "RabbitmqBroker":
            # Opens and authenticates this thread's connection (the relay publishes on it).
            _ = target.connection  # type: ignore[attr-defined]
        elif kind == "RedisBroker":
            target.client.ping()  # type: ignore[attr-defined]
    except Exception as e:
        chain = _chain(e)
        detail = " ".join(" ".join(f"{type(x).__name__}: {x}" for x in chain).split())[:300]
        if not any(str(x) for x in chain):
            # pika's AMQPConnectionError may carry nothing once its connection attempts ran out.
            raise TargetUnusable(
                f"cannot connect to {shown}: no connection ({type(e).__name__}). "
                "Check that the server runs and the host and port in --to"
            ) from None
        if refused_credentials(e):
            raise TargetUnusable(
                f"{shown} refused the relay's credentials ({detail}). "
                "Check the user name and password in --to"
            ) from None
        if isinstance(e, socket.gaierror) or "Name or service not known" in detail:
            raise TargetUnusable(f"cannot connect to {shown}: unknown host. Check the host in --to") from None
        if "refused" in detail.lower():
            raise TargetUnusable(
                f"cannot connect to {shown}: connection refused. "
                "Check that the server runs and the host and port in --to"
            ) from None
        raise TargetUnusable(f"cannot connect to {shown}: {detail}. Check --to") from None


class _Publisher:
    """Publish a batch of messages to a target broker; which of them it confirmed."""

    def __init__(self, target: Broker) -> None:
        self.target = target

    def publish(self, messages: list[Message[Any]]) -> set[int]:
        """Publish ``messages`` in order.  Returns the indexes the target confirmed.

        Raises:
          TargetError: With ``confirmed``, the indexes confirmed before the failure.
        """
        confirmed: set[int] = set()
        for i, message in enumerate(messages):
            try:
                self.target.enqueue(message)
            except Exception as e:
                raise TargetError(f"{type(e).__name__}: {e}", confirmed) from e
            confirmed.add(i)
        return confirmed


class _RabbitmqPublisher(_Publisher):
    """One AMQP transaction per batch on a channel of the target's connection (its thread's).

    The publishes are what ``RabbitmqBroker.enqueue`` sends (default exchange, routing key
    the queue, persistent, ``broker_priority``), after the same queue declarations, with the
    target's ``enqueue`` middleware hooks; only the confirmation differs.
    """

    def __init__(self, target: Broker) -> None:
        super().__init__(target)
        import pika

        self._pika = pika
        self._channel: Any = None
        self._returned: list[bytes] = []

    def _open(self) -> Any:
        if self._channel is None or not self._channel.is_open:
            channel = self.target.connection.channel()  # type: ignore[attr-defined]
            channel.tx_select()
            channel.add_on_return_callback(lambda _ch, _method, _props, body: self._returned.append(body))
            self._channel = channel
        return self._channel

    def publish(self, messages: list[Message[Any]]) -> set[int]:
        pika = self._pika
        target: Any = self.target
        bodies = [message.encode() for message in messages]
        self._returned = []
        try:
            for queue_name in dict.fromkeys(m.queue_name for m in messages):
                target.declare_queue(queue_name, ensure=True)
            channel = self._open()
            for message, body in zip(messages, bodies, strict=True):
                target.emit_before("enqueue", message, None)
                channel.basic_publish(
                    exchange="",
                    routing_key=message.queue_name,
                    body=body,
                    properties=pika.BasicProperties(
                        delivery_mode=2, priority=message.options.get("broker_priority")
                    ),
                    mandatory=True,
                )
            channel.tx_commit()
            target.connection.process_data_events(time_limit=0)  # runs the return callbacks
        except Exception as e:
            # The transaction did not commit (or its commit-ok was lost): nothing counts as
            # delivered.  A new connection and channel for the next batch.
            self._channel = None
            try:
                del target.connection
            except Exception:  # already gone
                pass
            raise TargetError(f"{type(e).__name__}: {e}") from e
        returned = set(self._returned)
        confirmed = {i for i, body in enumerate(bodies) if body not in returned}
        for i in confirmed:
            target.emit_after("enqueue", messages[i], None)
        if returned:
            # Unroutable: its queue was deleted since it was declared.  Declare it again next time.
            for i in set(range(len(messages))) - confirmed:
                target.queues_pending.add(messages[i].queue_name)
            raise TargetError(f"{len(returned)} message(s) returned as unroutable", confirmed)
        return confirmed


class _RedisPublisher(_Publisher):
    """Dramatiq's own enqueue script for each message of the batch, in one pipeline.

    The arguments are those ``RedisBroker.enqueue`` passes to it (Dramatiq 2.x's
    ``_dispatch``), maintenance excluded (the target's consumers do it).
    """

    def publish(self, messages: list[Message[Any]]) -> set[int]:
        target: Any = self.target
        try:
            dispatch = target.scripts["dispatch"]
            pipe = target.client.pipeline(transaction=False)
            stamped = []
            for message in messages:
                message = message.copy(options={"redis_message_id": str(uuid.uuid4())})
                target.emit_before("enqueue", message, None)
                # The arguments of Dramatiq's RedisBroker._dispatch("enqueue"), maintenance off.
                args = [
                    "enqueue", current_millis(), message.queue_name, target.broker_id,
                    target.heartbeat_timeout, target.dead_message_ttl, 0, target._max_unpack_size(),
                    message.options["redis_message_id"], message.encode(),
                ]  # fmt: skip
                dispatch(keys=[target.namespace], args=args, client=pipe)
                stamped.append(message)
            pipe.execute()
        except Exception as e:
            raise TargetError(f"{type(e).__name__}: {e}") from e
        for message in stamped:
            target.emit_after("enqueue", message, None)
        return set(range(len(messages)))


def publisher_for(target: Broker) -> _Publisher:
    """The fastest publisher that knows ``target``'s class; ``enqueue()`` one by one otherwise."""
    kind = f"{type(target).__module__}.{type(target).__name__}"
    if kind == "dramatiq.brokers.rabbitmq.RabbitmqBroker":
        return _RabbitmqPublisher(target)
    if kind == "dramatiq.brokers.redis.RedisBroker":
        return _RedisPublisher(target)
    return _Publisher(target)


def target_broker(url: str) -> Broker:
    """Dramatiq's RabbitmqBroker (``amqp://``, ``amqps://``; with publisher confirms) or RedisBroker
    (``redis://``, ``rediss://``, ``unix://``) for a URL.

    Raises:
      ValueError: For another scheme.
      ImportError: If pika (RabbitMQ) or redis is not installed (``pip install 'dramatiq[rabbitmq]'``
        or ``'dramatiq[redis]'``).
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("amqp", "amqps"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url, confirm_delivery=True)
    if scheme in ("redis", "rediss", "unix"):
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=url)
    raise ValueError(f"--to must be an amqp://, amqps://, redis:// or rediss:// URL, not {scheme or url!r}")
