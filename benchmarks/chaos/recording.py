"""The actors' record of their deliveries: statements that survive the faults the suites inject."""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg


class Recorder:
    """Runs one autocommit statement at a time on this process's own connection to ``url``.

    The actors' bookkeeping must survive the faults the chaos suite and the history checker
    inject (terminated connections, a database restart): a lost connection is opened again
    and the statement retried every ``pause`` seconds for up to ``retry_for`` seconds, more
    than any scenario's outage.  One connection per process id (a worker process forked
    from another opens its own).
    """

    def __init__(self, url: str, *, retry_for: float = 60.0, pause: float = 0.2) -> None:
        self.url = url
        self.retry_for = retry_for
        self.pause = pause
        self._conn: dict[int, psycopg.Connection[Any]] = {}

    def __call__(self, query: str, params: Any) -> Any:
        """The first column of the statement's first row, or None.

        Raises:
          psycopg.OperationalError: If the database stayed unreachable for ``retry_for`` seconds.
        """
        deadline = time.monotonic() + self.retry_for
        while True:
            conn = self._conn.get(os.getpid())
            try:
                if conn is None or conn.closed:
                    conn = self._conn[os.getpid()] = psycopg.connect(
                        self.url, autocommit=True, connect_timeout=5
                    )
                cur = conn.execute(query, params)
                row = cur.fetchone() if cur.description else None
                return None if row is None else row[0]
            except psycopg.OperationalError:
                self._conn.pop(os.getpid(), None)
                if time.monotonic() > deadline:
                    raise
                time.sleep(self.pause)
