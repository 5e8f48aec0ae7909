"""The broker and the periodic actor of the example.

Loaded by the ``dramatiq`` workers and by each ``dramatiq-pg-outbox scheduler
--app examples.periodic_jobs.tasks`` process.  Configuration from the
environment, which ``run.py`` sets: ``EXAMPLE_DATABASE_URL`` (the example's
database).
"""

from __future__ import annotations

import os

import dramatiq
import psycopg

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.periodic import Periodic, periodic

broker = PostgresBroker(url=os.environ["EXAMPLE_DATABASE_URL"])
# Standalone schedulers only (``dramatiq-pg-outbox scheduler``): the workers just run the jobs.
broker.add_middleware(Periodic(run_in_workers=False, poll_interval=1_000))
dramatiq.set_broker(broker)


@periodic(every=1_000, tick_kwarg="tick")
@dramatiq.actor(max_retries=3)
def every_second(tick: str) -> None:
    """Record that the job of ``tick`` ran (and in which process), in the example's own table."""
    with psycopg.connect(os.environ["EXAMPLE_DATABASE_URL"], autocommit=True) as conn:
        conn.execute("INSERT INTO job_runs (tick, pid) VALUES (%s, %s)", (tick, os.getpid()))
