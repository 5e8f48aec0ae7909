"""The Dramatiq app of the history checker's worker processes (``dramatiq benchmarks.chaos.checker_app``).

Configured from the environment by :mod:`benchmarks.chaos.checker`:

- ``CHECK_URL``: the broker's database URL (through the checker's TCP proxy, which it cuts).
- ``CHECK_RECORD_URL``: where the actors record their deliveries, reached directly so that a
  cut never loses a record.
- ``CHECK_<OPTION>``: an integer broker option (``CHECK_MAX_LEASE=1500``...).

Every delivery of every actor ends with one row in ``chk_runs`` (token, step, message id, row
id, lease, attempts, pid, start and end on the machine's clock), written in its own committed
transaction before the actor returns: a delivery without a row did not run to its end.  What a
delivery does is chosen by its ``mode`` argument:

``ok``       returns ``token``.
``retry``    raises on the message's first delivery (``retries`` 0); Retries stores the retry.
``hold``     sleeps 20-100 ms, then returns ``token`` (a concurrency key's slot held a while).
``slow``     on its first delivery (``attempts`` 1) runs until its lease was taken over (the
             broker's ``max_lease`` released it and another delivery claimed it), then a few
             milliseconds more: the stale delivery ends beside the current one.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage
from dramatiq.middleware.group_callbacks import GroupCallbacks
from dramatiq.results import Results

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.rate_limits import PostgresBackend as RateLimiterBackend
from dramatiq_pg_outbox.results import PostgresBackend as ResultBackend

from .recording import Recorder

#: Broker options that can be set with ``CHECK_<NAME>``.
OPTIONS = (
    "max_lease",
    "max_deliveries",
    "max_fetch_interval",
    "flush_interval",
    "heartbeat_interval",
    "heartbeat_timeout",
    "rescue_interval",
    "rotate_interval",
)
QUEUE = "chk"

RECORD_URL = os.environ.get("CHECK_RECORD_URL", os.environ.get("CHECK_URL", ""))


def make_broker(url: str, **settings: Any) -> PostgresBroker:
    """A broker with the middleware the checker's actors use: CurrentMessage, results, group callbacks."""
    made = PostgresBroker(url=url, **settings)
    made.add_middleware(CurrentMessage())
    made.add_middleware(Results(backend=ResultBackend(broker=made, pool_size=2)))
    made.add_middleware(GroupCallbacks(RateLimiterBackend(url=url)))
    return made


def close_broker(made: PostgresBroker) -> None:
    """Close the broker and the backends of its middleware."""
    for middleware in made.middleware:
        backend = getattr(middleware, "backend", None) or getattr(middleware, "rate_limiter_backend", None)
        close = getattr(backend, "close", None)
        if close is not None and backend is not made:
            close()
    made.close()


#: One row per delivery that ran to its end; ``claimed`` is the claim's time if the row still
#: carried this delivery's lease when it ended (NULL: its lease had expired or been released).
#: ``run`` is the delivery's own id: an insert retried after its reply was lost is not a second run.
RECORD = """
INSERT INTO chk_runs
    (run, token, step, message_id, row_id, lease, attempts, retries, pid, started, ended, taken_over, claimed)
SELECT %(run)s, %(token)s, %(step)s, %(message_id)s, %(row_id)s, %(lease)s, %(attempts)s, %(retries)s,
       %(pid)s, %(started)s, %(ended)s, %(taken_over)s,
       (SELECT extract(epoch FROM acquired_at)::float8 FROM dramatiq.messages
        WHERE id = %(row_id)s AND lease = %(lease)s::uuid)
ON CONFLICT (run) DO NOTHING
"""


#: One autocommit statement on this process's own direct connection (see Recorder).
execute = Recorder(RECORD_URL, pause=0.1)


def _delivery() -> Any:
    message = CurrentMessage.get_current_message()
    assert message is not None
    return message


def _record(token: str, step: str, started: float, taken_over: bool = False) -> None:
    m = _delivery()
    params = {
        "run": str(uuid.uuid4()),
        "token": token, "step": step, "message_id": m.message_id, "row_id": getattr(m, "row_id", None),
        "lease": str(getattr(m, "lease", "")) or None, "attempts": getattr(m, "attempts", None),
        "retries": m.options.get("retries", 0), "pid": os.getpid(), "started": started, "ended": time.time(),
        "taken_over": taken_over,
    }  # fmt: skip
    execute(RECORD, params)


def _wait_for_takeover() -> bool:
    """Until this delivery's row carries another lease (or is gone), at most 5 s: whether it was.

    Bounded so that a stopping worker (no rescuer left to take the lease over) is not held."""
    m = _delivery()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lease = execute("SELECT lease::text FROM dramatiq.messages WHERE id = %s", (m.row_id,))
        if lease != str(m.lease):
            time.sleep(random.uniform(0, 0.008))
            return True
        time.sleep(0.005)
    return False


def rec(token: str, step: str, mode: str = "ok") -> str:
    started = time.time()
    m = _delivery()
    if mode == "hold":
        time.sleep(random.uniform(0.02, 0.1))  # holds its concurrency key's slot a while
    taken_over = mode == "slow" and getattr(m, "attempts", 0) == 1 and _wait_for_takeover()
    _record(token, step, started, taken_over)
    if mode == "retry" and m.options.get("retries", 0) == 0:
        raise RuntimeError(f"first delivery of {token}/{step} fails on purpose")
    return token


def callback(message: dict[str, Any], result: str) -> None:
    """An ``on_success`` callback: records the token its message returned."""
    _record(result, "callback", time.time())


def spark_rec(key: str) -> None:
    """The actor of the checker's Spark writer tasks (its message id is derived from the key)."""
    _record(key, "spark", time.time())


def declare(on: PostgresBroker) -> dict[str, dramatiq.Actor[Any, Any]]:
    """The checker's actors on a broker (the workers' and the checker's own, which only sends)."""
    return {
        "rec": dramatiq.actor(
            rec,
            broker=on,
            queue_name=QUEUE,
            max_retries=3,
            min_backoff=20,
            max_backoff=100,
            store_results=True,
            # Results live a day: the check looks for every completed message's result at the end of
            # a run (Dramatiq's default of 10 minutes expired them in 30-minute runs).
            result_ttl=86_400_000,
        ),
        "callback": dramatiq.actor(callback, broker=on, queue_name=QUEUE, max_retries=0),
        "spark_rec": dramatiq.actor(spark_rec, broker=on, queue_name=QUEUE, max_retries=0),
    }


if "CHECK_URL" in os.environ:  # a worker process of the dramatiq CLI
    broker = make_broker(
        os.environ["CHECK_URL"],
        **{
            name: int(os.environ[f"CHECK_{name.upper()}"])
            for name in OPTIONS
            if f"CHECK_{name.upper()}" in os.environ
        },
    )
    dramatiq.set_broker(broker)
    declare(broker)
