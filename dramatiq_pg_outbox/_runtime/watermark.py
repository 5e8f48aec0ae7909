"""Where a claim starts reading: :class:`Watermark` (issue 20, a pinned MVCC horizon).

A claimed row leaves a dead entry in ``messages_ready_idx`` that vacuum removes, and
that a scan marks (so that the next one skips it) only once no transaction can still
see the row.  While a long transaction, a replication slot or ``hot_standby_feedback``
pins that horizon, a claim that starts at the queue's first entry visits every entry
claimed since.  A claimer (a consumer, the relay) keeps a :class:`Watermark`: its
claims start after the claim-order key ``(next_attempt_at, id)`` of the latest row it
claimed ``lag_ms`` ago, and now and then it sweeps from the start, which finds what a
watermark passes over (rows committed late, rows handed back).  The SQL side is the
``claim_from`` fragment of queries.sql; docs/design.md, "Claims while the horizon is
pinned", gives the measurements.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

#: A claim-order key: (next_attempt_at, id).
Key = tuple[datetime.datetime, int]

#: How long ago, in milliseconds, the claimer claimed the row after which its claims
#: start reading.  A row that sorts before it but commits later (its transaction
#: inserted it more than about this long before it committed) waits for a sweep.
LAG_MS = 1_000
#: Least time between two sweeps (claims from the queue's first entry), in milliseconds.
SWEEP_INTERVAL_MS = 1_000
#: A sweep waits at least this many times as long as the last one took, so that
#: sweeps, which read every dead index entry while the horizon is pinned, take at
#: most a tenth of the claimer's time.
SWEEP_SPACING = 10


class Watermark:
    """The watermark of one claimer, used from one thread (:meth:`owe_sweep` from any).

    Usage: ``sweep, bound = w.start(now)``, claim with the parameters ``bound``
    (``from_at``, ``from_id``: both None for a sweep), then
    ``w.claimed(keys, full=..., sweep=sweep, sent=now)``; an idle claimer also wakes
    at :meth:`wake_at`.

    Parameters:
      lag_ms(int): See :data:`LAG_MS`.  Default: the module's value at construction.
      sweep_interval_ms(int): See :data:`SWEEP_INTERVAL_MS`.
    """

    def __init__(self, lag_ms: int | None = None, sweep_interval_ms: int | None = None) -> None:
        self.lag_ms = LAG_MS if lag_ms is None else lag_ms
        self.sweep_interval_ms = SWEEP_INTERVAL_MS if sweep_interval_ms is None else sweep_interval_ms
        #: (time.monotonic(), key) of the latest row of each claim, oldest first.
        self._marks: deque[tuple[float, Key]] = deque()
        #: The newest key claimed lag_ms ago or more (None: the next claim sweeps).
        self.key: Key | None = None
        #: time.monotonic() from which the next claim is a sweep.
        self.sweep_at = 0.0
        #: Whether something was stored or released since the last sweep began (a
        #: notification): the claimer should then claim at sweep_at even if idle.
        self.sweep_owed = False
        #: Sweeps made.
        self.sweeps = 0

    def owe_sweep(self) -> None:
        """Something may have been stored or handed back behind the watermark: sweep at ``sweep_at``."""
        self.sweep_owed = True

    def wake_at(self) -> float:
        """``time.monotonic()`` at which an idle claimer should claim (a sweep is owed), or inf."""
        return self.sweep_at if self.sweep_owed else float("inf")

    def start(self, now: float) -> tuple[bool, dict[str, Any]]:
        """(whether this claim is a sweep, its ``from_at`` and ``from_id`` parameters).

        The parameters are the key after which the claim reads, both None for a sweep.

        Parameters:
          now(float): ``time.monotonic()`` as the claim is sent.
        """
        horizon = now - self.lag_ms / 1000
        while self._marks and self._marks[0][0] <= horizon:
            self.key = self._marks.popleft()[1]
        sweep = self.key is None or now >= self.sweep_at
        if sweep:
            self.sweep_owed = False
        after = None if sweep else self.key
        return sweep, {
            "from_at": None if after is None else after[0],
            "from_id": None if after is None else after[1],
        }

    def claimed(self, keys: Iterable[Key], *, full: bool, sweep: bool, sent: float) -> None:
        """Remember the latest key a claim returned; after a sweep, plan the next one.

        A sweep that came back full of rows behind the watermark (a large transaction
        that committed late, many rows handed back) may have left more: the next
        claim sweeps again.

        Parameters:
          keys: The claim-order keys of the rows claimed (the ones that move the watermark).
          full(bool): Whether the claim returned as many rows as it asked for.
          sweep(bool): Whether it was a sweep (from :meth:`start`).
          sent(float): The ``now`` given to :meth:`start`.
        """
        latest = max(keys, default=None)
        newest = self._marks[-1][1] if self._marks else self.key
        if latest is not None and (newest is None or latest > newest):
            self._marks.append((sent, latest))
        if not sweep:
            return
        self.sweeps += 1
        if full and latest is not None and self.key is not None and latest < self.key:
            self.sweep_at = 0.0
            return
        took = time.monotonic() - sent
        self.sweep_at = sent + max(self.sweep_interval_ms / 1000, SWEEP_SPACING * took)
