"""The broker and the ``notify_customer`` actor, loaded by the workers::

    dramatiq examples.spark_pipeline.tasks --processes 2 --threads 8

``EXAMPLE_DATABASE_URL`` names the example's database (set by ``run.py``).

The actor "sends" a notification by recording it in the ``notifications``
table, counting deliveries per customer, so the report can prove that every
customer was notified exactly once.  Every 500th customer's first attempt
fails with a (simulated) ``SmtpTimeout``: Dramatiq's Retries middleware
retries it, and the analytics show the retries and the error type.
"""

from __future__ import annotations

import os
import threading

import dramatiq
from dramatiq.middleware import CurrentMessage
from psycopg_pool import ConnectionPool

from dramatiq_pg_outbox import PostgresBroker


def database_url() -> str:
    url = os.environ.get("EXAMPLE_DATABASE_URL")
    if not url:
        raise RuntimeError(
            "EXAMPLE_DATABASE_URL is not set: start the example with `python -m examples.spark_pipeline`."
        )
    return url


broker = PostgresBroker(url=database_url(), pool_size=4)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)

_pool: ConnectionPool | None = None
_pool_lock = threading.Lock()


def pool() -> ConnectionPool:
    """This process's connection pool for the actor's writes (workers are forked: opened lazily)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ConnectionPool(database_url(), min_size=1, max_size=8, kwargs={"autocommit": True})
        return _pool


class SmtpTimeout(Exception):
    """A simulated transient failure of the mail relay."""


@dramatiq.actor(queue_name="notifications", max_retries=3, min_backoff=200, max_backoff=2_000)
def notify_customer(customer_id: int, email: str, segment: str) -> None:
    message = CurrentMessage.get_current_message()
    first_attempt = message is None or not message.options.get("retries")
    if customer_id % 500 == 7 and first_attempt:
        raise SmtpTimeout(f"relay timed out for {email}")
    with pool().connection() as conn:
        conn.execute(
            "INSERT INTO notifications (customer_id, segment, deliveries) VALUES (%s, %s, 1) "
            "ON CONFLICT (customer_id) DO UPDATE SET deliveries = notifications.deliveries + 1",
            (customer_id, segment),
        )
