"""Spread per-customer work over a window: one periodic job plans it, delays pace it.

A nightly job that sends one message per customer, all due at once, is a burst
that the workers, and whatever the actors call, must take at once.  Instead,
one cron job enqueues every customer's message with a delay sampled over the
next 24 hours: the work arrives evenly, and each delayed message waits in the
table, not in a worker's memory, until it is due.  The periodic jobs guide
(docs/guides/periodic.md) shows this function; ``tests/test_periodic.py`` runs it.

Usage (in the application's tasks module)::

    @periodic("0 0 * * *", tz="Europe/Paris", tick_kwarg="tick")
    @dramatiq.actor
    def plan_customer_syncs(tick: str) -> None:
        spread(broker, sync_customer, customer_ids(), tick=tick)
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from dramatiq import Actor, Message

from dramatiq_pg_outbox import PostgresBroker

#: 24 hours, in milliseconds.
DAY_MS = 86_400_000


def spread(
    broker: PostgresBroker,
    actor: Actor[..., Any],
    customer_ids: Iterable[int],
    *,
    tick: str,
    window_ms: int = DAY_MS,
    step_ms: int = 60_000,
    rng: random.Random | None = None,
) -> int:
    """Enqueue ``actor(customer_id)`` once per customer, each due at a random step of the window.

    One ``enqueue_many`` per distinct delay (at most ``window_ms / step_ms``
    statements: 1,440 for a day in minutes).  The idempotency key
    ``<actor>:<tick>:<customer>`` makes a second run for the same tick (a
    retry, a redelivery after a crash) add nothing.  Returns the messages planned.
    """
    rng = rng or random.Random()
    by_delay: defaultdict[int, list[Message[Any]]] = defaultdict(list)
    for customer_id in customer_ids:
        key = f"{actor.actor_name}:{tick}:{customer_id}"
        message = actor.message_with_options(args=(customer_id,), idempotency_key=key)
        by_delay[rng.randrange(0, window_ms, step_ms)].append(message)
    for delay, messages in sorted(by_delay.items()):
        broker.enqueue_many(messages, delay=delay)
    return sum(len(messages) for messages in by_delay.values())
