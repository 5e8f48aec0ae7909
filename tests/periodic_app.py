"""An application with periodic jobs, for ``dramatiq-pg-outbox scheduler --app tests.periodic_app``.

Configured from the environment: ``DPO_TEST_URL`` (database), ``DPO_SCHEMA``
(schema), ``DPO_HOLD_MS`` (each ``before_enqueue`` sleeps this long: the
scheduler then holds its schedule's row lock, inside its open transaction,
long enough for a test to kill it right there).
"""

from __future__ import annotations

import os
import time
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.periodic import Periodic, periodic


class HoldTransaction(Middleware):
    """Sleeps in ``before_enqueue``: called inside the scheduler's transaction."""

    def __init__(self, hold_ms: int) -> None:
        self.hold = hold_ms / 1000

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        time.sleep(self.hold)


broker = PostgresBroker(url=os.environ["DPO_TEST_URL"], schema=os.environ.get("DPO_SCHEMA", "dramatiq"))
# Declarations only: the standalone schedulers read the options from here.
broker.add_middleware(Periodic(run_in_workers=False, poll_interval=1_000))
if int(os.environ.get("DPO_HOLD_MS", "0")):
    broker.add_middleware(HoldTransaction(int(os.environ["DPO_HOLD_MS"])))
dramatiq.set_broker(broker)


# A 1 s schedule; a grace of 60 s so that a stall of this loaded test machine
# delays ticks but never turns them into missed ones.
@periodic(every=1_000, grace=60_000)
@dramatiq.actor
def tick() -> None:
    pass
