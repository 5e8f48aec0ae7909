"""The broker and the ``send_welcome_email`` actor.

This module is what the workers load::

    dramatiq examples.transactional_email.tasks --processes 2 --threads 8

It reads its configuration from environment variables, which ``run.py`` sets
for itself and for the workers it starts:

``EXAMPLE_DATABASE_URL``  the example's database (broker tables and ``users``).
``EXAMPLE_SMTP_HOST``     the SMTP server the emails go to (default ``127.0.0.1``).
``EXAMPLE_SMTP_PORT``     its port (default ``8025``).
``EXAMPLE_QUEUE``         the queue of the actor (default ``default``).
``EXAMPLE_CONSUME_FROM``  unset: the workers consume the PostgreSQL queue.  An
                          ``amqp://`` or ``redis://`` URL (relay mode, set by
                          ``run.py --relay`` for the workers only): the workers are
                          ordinary ``RabbitmqBroker`` / ``RedisBroker`` workers of
                          that server, and ``dramatiq-pg-outbox relay`` moves the
                          committed messages there; the application still
                          enqueues through the outbox into PostgreSQL.
"""

from __future__ import annotations

import os
import smtplib
import threading

import dramatiq
from dramatiq import Broker
from sqlalchemy import Engine

from dramatiq_pg_outbox import PostgresBroker

from .emails import welcome_email
from .models import engine_for, load_user_email


def database_url() -> str:
    """The example database's URL, from ``EXAMPLE_DATABASE_URL``."""
    url = os.environ.get("EXAMPLE_DATABASE_URL")
    if not url:
        raise RuntimeError(
            "EXAMPLE_DATABASE_URL is not set: start the example with "
            "`python -m examples.transactional_email`, which sets it."
        )
    return url


def make_broker() -> Broker:
    """The broker of this process: PostgreSQL's, or in relay mode the workers' RabbitMQ or Redis."""
    consume_from = os.environ.get("EXAMPLE_CONSUME_FROM")
    if not consume_from:
        return PostgresBroker(url=database_url())
    if consume_from.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=consume_from)
    from dramatiq.brokers.redis import RedisBroker

    return RedisBroker(url=consume_from)


broker = make_broker()
dramatiq.set_broker(broker)

_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """This process's SQLAlchemy engine, created on first use (worker processes are forked)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = engine_for(database_url(), pool_size=8)
        return _engine


class UserNotFound(LookupError):
    """The user of a message does not exist: the message outlived its signup's rollback."""


@dramatiq.actor(max_retries=3, throws=(UserNotFound,), queue_name=os.environ.get("EXAMPLE_QUEUE", "default"))
def send_welcome_email(user_id: int) -> None:
    """Email the welcome message to user ``user_id`` over SMTP.

    The message was enqueued in the signup's transaction, so the user row is
    always there.  A missing row would mean a message outlived a rollback (or
    ran before its commit): retrying cannot fix that, so ``UserNotFound`` is
    not retried and the message ends in the broker's history with its error,
    where ``run.py`` counts it.
    """
    address = load_user_email(engine(), user_id)
    if address is None:
        raise UserNotFound(f"user {user_id} does not exist")
    host = os.environ.get("EXAMPLE_SMTP_HOST", "127.0.0.1")
    port = int(os.environ.get("EXAMPLE_SMTP_PORT", "8025"))
    with smtplib.SMTP(host, port, timeout=30) as smtp:
        smtp.send_message(welcome_email(user_id, address))
