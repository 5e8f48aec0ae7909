"""The Dramatiq app run by the chaos suite's worker processes (``dramatiq benchmarks.chaos.app``).

Configuration comes from the environment so that the supervisor can start
real ``dramatiq`` CLI processes:

- ``CHAOS_URL``: the database.
- ``CHAOS_<OPTION>`` (upper case): an integer broker option, e.g.
  ``CHAOS_HEARTBEAT_TIMEOUT=2000``.  Unset options keep the broker's defaults,
  which is what most scenarios measure.
- ``CHAOS_WORK_MS``: time each ``work`` message spends "working" (default 0).
- ``CHAOS_RECORD_URL``: where the actors record deliveries (default ``CHAOS_URL``).
- ``CHAOS_RECORD``: ``0`` makes ``work`` record nothing (scenario 10).
- ``CHAOS_PERIODIC``: ``1`` adds the periodic job ``chaos_tick`` (every second, schedulers
  in the worker processes), which records each run in ``chaos_ticks`` (scenarios 13, 14).

Every delivery of a ``work`` or ``long_task`` message adds one to its key's
count in the table ``chaos_received`` (unique key + count), in its own
committed transaction: that table is the durable record the suite compares
with what was sent.  Keys starting with ``poison`` make ``work`` kill its own
process with ``os._exit`` (a poison message).  ``keyed_work`` (scenario 12) also
records each delivery's start and end in ``chaos_spans``.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.periodic import Periodic, periodic

from .recording import Recorder

#: Broker options that can be set with ``CHAOS_<NAME>``.
OPTIONS = (
    "pool_size",
    "max_deliveries",
    "max_fetch_interval",
    "min_fetch_interval",
    "flush_interval",
    "heartbeat_interval",
    "heartbeat_timeout",
    "rescue_interval",
)

URL = os.environ["CHAOS_URL"]
#: Where the actors record their deliveries: the broker's database, reached directly even when the
#: broker goes through the suite's proxy (scenario 9), so that a cut never hits the record itself.
RECORD_URL = os.environ.get("CHAOS_RECORD_URL", URL)
settings = {
    name: int(os.environ[f"CHAOS_{name.upper()}"])
    for name in OPTIONS
    if f"CHAOS_{name.upper()}" in os.environ
}
broker = PostgresBroker(url=URL, **settings)
broker.add_middleware(CurrentMessage())  # the message id and attempt that keyed_work records
PERIODIC = os.environ.get("CHAOS_PERIODIC", "0") == "1"
if PERIODIC:
    broker.add_middleware(Periodic(run_in_workers=True, poll_interval=500))
dramatiq.set_broker(broker)

WORK_MS = int(os.environ.get("CHAOS_WORK_MS", "0"))
#: ``CHAOS_RECORD=0``: ``work`` records nothing (scenario 10 counts history instead: its load is
#: the broker's alone, without a commit per message in chaos_received).
RECORDING = os.environ.get("CHAOS_RECORD", "1") != "0"
RECORD = (
    "INSERT INTO chaos_received (key, n) VALUES (%s, 1) "
    "ON CONFLICT (key) DO UPDATE SET n = chaos_received.n + 1, last_at = now()"
)


#: One autocommit statement on this process's own direct connection (see Recorder).
execute = Recorder(RECORD_URL)


@dramatiq.actor(max_retries=0)
def work(key: str) -> None:
    if key.startswith("poison"):
        execute("INSERT INTO chaos_started (key, pid) VALUES (%s, %s)", (key, os.getpid()))
        os._exit(1)
    if WORK_MS:
        time.sleep(WORK_MS / 1000)
    if RECORDING:
        execute(RECORD, (key,))


@dramatiq.actor(max_retries=0, time_limit=3_600_000)
def long_task(key: str, seconds: float) -> None:
    execute("INSERT INTO chaos_started (key, pid) VALUES (%s, %s)", (key, os.getpid()))
    time.sleep(seconds)
    execute(RECORD, (key,))


# -- scenario 12: concurrency keys under kill -9 and restarts ---------------------------------
# Each delivery records its own interval in chaos_spans: the start before the actor's work and the
# end after it, on the database's clock (clock_timestamp()), with its message id, attempt, process
# and concurrency key.  The start is written under a token of the delivery's own, so a retried
# statement (a restart cut the reply of one that committed) records one interval, not two.

SPAN_START = (
    "INSERT INTO chaos_spans (token, key, ckey, message_id, attempt, pid, started) "
    "VALUES (%s, %s, %s, %s, %s, %s, clock_timestamp()) ON CONFLICT (token) DO NOTHING"
)
SPAN_END = "UPDATE chaos_spans SET ended = clock_timestamp() WHERE token = %s"


@dramatiq.actor(max_retries=0)
def keyed_work(key: str, ms: int) -> None:
    """Works ``ms`` milliseconds between the records of its start and end; then counts the key."""
    message = CurrentMessage.get_current_message()
    assert message is not None
    token = uuid.uuid4()
    ckey = message.options.get("concurrency_key")
    attempt = getattr(message, "attempts", None)
    execute(SPAN_START, (token, key, ckey, message.message_id, attempt, os.getpid()))
    time.sleep(ms / 1000)
    execute(SPAN_END, (token,))
    execute(RECORD, (key,))


# -- scenario 9: follow-ups written with the ack -----------------------------------------------
# Each delivery is counted in chaos_attempts; the business key lands in chaos_received only once
# the follow-up it depends on ran: the retry (flaky), the next pipeline step (step_two) or the
# on_success callback (on_done).

ATTEMPT = (
    "INSERT INTO chaos_attempts (key, n) VALUES (%s, 1) "
    "ON CONFLICT (key) DO UPDATE SET n = chaos_attempts.n + 1 RETURNING n"
)


@dramatiq.actor(max_retries=10, min_backoff=100, max_backoff=1_000)
def flaky(key: str) -> None:
    """Fails at its first delivery; Retries stores the retry as the actor ends."""
    if int(execute(ATTEMPT, (key,))) == 1:
        raise RuntimeError(f"first delivery of {key} fails on purpose")
    execute(RECORD, (key,))


@dramatiq.actor(max_retries=0)
def step_one(key: str) -> str:
    """First step of a pipeline: its result is the next step's argument."""
    return key


@dramatiq.actor(max_retries=0)
def step_two(key: str) -> None:
    execute(RECORD, (key,))


@dramatiq.actor(max_retries=0)
def succeed(key: str) -> str:
    """Sent with on_success=on_done."""
    return key


@dramatiq.actor(max_retries=0)
def on_done(message: dict[str, Any], result: str) -> None:
    execute(RECORD, (result,))


# -- scenarios 13 and 14: the periodic scheduler follows a failover -----------------------------

if PERIODIC:

    @periodic(every=1_000, grace=60_000)
    @dramatiq.actor(max_retries=0)
    def chaos_tick() -> None:
        """Records its run (the ledger's clock) in chaos_ticks."""
        execute("INSERT INTO chaos_ticks (at) VALUES (clock_timestamp())", ())
