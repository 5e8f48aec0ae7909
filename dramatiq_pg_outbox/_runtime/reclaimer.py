"""The reclaim loop of a process: turns the ring of message partitions and empties the drained ones."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from ..names import PARK_AFTER_MS
from .host import Runtime
from .service import Service

#: The ring never grows beyond this many partitions (migration 0013 creates 4): when none is
#: empty, the current one keeps the inserts.
MAX_SLOTS = 8
#: Pending rows moved out of an older partition per call at most; more is a backlog, which the
#: consumers drain in order.
MAX_MOVED = 1_000
#: Passes per ``rotate_interval``.
PASSES_PER_ROTATION = 5


@dataclass(frozen=True)
class ReclaimResult:
    """What one call of ``reclaim_messages`` did (``None`` from :meth:`Reclaimer.run_once`
    when another process held the ring)."""

    #: The ring's current slot after the call.
    slot: int
    #: Whether the ring turned.
    rotated: bool
    #: Pending rows moved out of older partitions.
    moved: int
    #: Partitions emptied by TRUNCATE.
    truncated: int
    #: Partitions skipped because a transaction held them (never waited for).
    busy: int


class Reclaimer(Service):
    """Calls ``<schema>.reclaim_messages`` 5 times per ``rotate_interval`` (a :class:`~.service.Service`).

    Any number of processes may run it: the function takes the ring's row with
    ``FOR UPDATE SKIP LOCKED``, so one call works and the others return at once.
    What a call does is in alembic/versions/0013_message_ring.py and docs/design.md
    ("Reclaiming storage without vacuum").  Without EXECUTE on the function (a
    worker role not granted it), says so once and stops: the ring then stays on its
    current partition, which vacuum keeps as before; nothing is lost.
    """

    name = "reclaim"

    def __init__(self, runtime: Runtime) -> None:
        interval_ms = runtime.broker.options.rotate_interval
        super().__init__(interval_ms / 1000 / PASSES_PER_ROTATION, jitter=0.2)
        self.runtime = runtime
        self.rotate_interval = interval_ms
        self._denied = False

    def run_once(self) -> ReclaimResult | None:
        """One call; its counts, or None when another process held the ring (or EXECUTE is denied)."""
        if self._denied:
            return None
        try:
            with self.runtime.connection() as conn:
                row = self.runtime.store.reclaim_messages(
                    conn,
                    rotate_ms=self.rotate_interval,
                    park_after_ms=PARK_AFTER_MS,
                    max_slots=MAX_SLOTS,
                    channel=self.runtime.channel,
                    max_moved=MAX_MOVED,
                )
        except psycopg.errors.InsufficientPrivilege:
            self._denied = True
            self.interval = 3_600.0
            self.logger.warning(
                "This role may not reclaim message partitions: the messages table is then reclaimed "
                "by vacuum only. GRANT EXECUTE ON FUNCTION %s.reclaim_messages TO this role "
                "(docs/security.md)",
                self.runtime.broker.schema,
            )
            return None
        if row is None:
            return None
        return ReclaimResult(
            int(row.slot), bool(row.rotated), int(row.moved), int(row.truncated), int(row.busy)
        )
