"""The maintenance loop of a process: heartbeat, release-stuck (rescue), orphans, history partitions."""

from __future__ import annotations

import math
import os
import random
import socket
import time
from dataclasses import dataclass

import psycopg

from .host import Runtime
from .service import Service

#: Claims younger than this are never treated as orphans, in milliseconds.
ORPHAN_GRACE_MS = 30_000
#: Seconds between two calls of create_history_partitions by a maintenance loop (jittered +-20%).
PARTITIONS_INTERVAL_S = 3_600
#: Days of history partitions a maintenance loop keeps ahead (today is day 0).
PARTITIONS_DAYS_AHEAD = 7


@dataclass(frozen=True)
class RescueResult:
    """Counts from one release-stuck pass."""

    released: int
    quarantined: int
    dead_workers: int
    #: Claims of dead workers that an operator asked to cancel: archived as canceled.
    canceled: int = 0


class Maintenance(Service):
    """The maintenance loop of a process, every ``heartbeat_interval`` ms (a :class:`~.service.Service`).

    Each pass heartbeats and looks for cancel requests of this process's claims (the
    fallback of the ``cancel:<row id>`` notifications); about every ``rescue_interval``
    ms (+-20 %) it releases the claims of dead workers and this process's orphans; about
    hourly it creates history partitions.  A failed pass is retried after 100 ms,
    doubling up to the interval.
    """

    name = "maintenance"

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime.broker.options.heartbeat_interval / 1000)
        self.runtime = runtime
        self.hostname = socket.gethostname()
        self._next_rescue = 0.0
        self._next_partitions = 0.0
        #: time.monotonic() from which this process may judge others dead (see run_once).
        self._rescue_from = 0.0
        #: time.monotonic() of the last heartbeat of this process (the runtime heartbeats before
        #: it starts this loop).
        self._beat_at = time.monotonic()

    def run_once(self) -> RescueResult | None:
        """One pass; the rescue's counts when it ran."""
        self.heartbeat()
        self.poll_cancels()
        now = time.monotonic()
        broker = self.runtime.broker
        if now - self._beat_at > 2 * broker.options.heartbeat_interval / 1000:
            # Its own heartbeat was late (the database was out of reach, or slow to answer): the
            # others' heartbeats are probably stale for the same reason, not because they died.
            # Judge nobody before they have had a full heartbeat_timeout to heartbeat again;
            # otherwise the first process back releases the running messages of the others
            # (146 duplicates without this in `python -m benchmarks.chaos --quick --scenarios 9`, 0 with it).
            self._rescue_from = now + broker.options.heartbeat_timeout / 1000
        self._beat_at = now
        if now < self._rescue_from:
            return None
        if now >= self._next_partitions:
            self._next_partitions = now + PARTITIONS_INTERVAL_S * random.uniform(0.8, 1.2)
            self.create_partitions()
        if now >= self._next_rescue:
            # Jitter spreads the rescuers of many processes over the interval.
            interval = self.runtime.broker.options.rescue_interval / 1000
            self._next_rescue = now + interval * random.uniform(0.8, 1.2)
            result = self.rescue()
            if result.canceled:
                self.logger.warning(
                    "Archived %d message(s) of dead workers as canceled (an operator canceled them)",
                    result.canceled,
                )
            if result.released or result.quarantined:
                self.logger.warning(
                    "Released %d message(s) of dead workers; quarantined %d after max_deliveries=%d",
                    result.released,
                    result.quarantined,
                    self.runtime.broker.options.max_deliveries,
                )
            orphans = self.release_orphans()
            if orphans:
                self.logger.warning("Released %d orphaned claim(s) of this process", orphans)
            return result
        return None

    def create_partitions(self) -> int:
        """Create the history partitions of the next days (at start, then about hourly).

        Without EXECUTE on the function (a worker role not granted it), says so once and
        stops trying: rows then land in ``history_default`` until an operator runs
        ``dramatiq-pg-outbox maintain``; nothing is lost.
        """
        try:
            with self.runtime.connection() as conn:
                created = self.runtime.store.create_history_partitions(conn, days=PARTITIONS_DAYS_AHEAD)
        except psycopg.errors.InsufficientPrivilege:
            self._next_partitions = math.inf
            self.logger.warning(
                "This role may not create history partitions: archived rows go to history_default. "
                "GRANT EXECUTE ON FUNCTION %s.create_history_partitions TO this role (docs/security.md), "
                "or run 'dramatiq-pg-outbox maintain' daily as the owner",
                self.runtime.broker.schema,
            )
            return 0
        return created

    def heartbeat(self) -> None:
        """Insert or refresh this process's ``workers`` row."""
        runtime = self.runtime
        queues, running = runtime.queue_names(), runtime.running_ids()
        with runtime.connection() as conn:
            runtime.store.heartbeat(
                conn,
                id=runtime.worker_id,
                hostname=self.hostname,
                pid=os.getpid(),
                queues=queues,
                running=running,
                actors=sorted(runtime.broker.get_declared_actors()),
            )

    def poll_cancels(self) -> int:
        """Stop the claims of this process that an operator canceled; how many were told now.

        The notification ``cancel:<row id>`` tells at once; this poll (one statement per
        pass, none while the process holds no claim) covers a notification missed or
        not sent (``listen=False``, a reconnect).
        """
        runtime = self.runtime
        held = runtime.known_claims()
        if not held:
            return 0
        with runtime.connection() as conn:
            requested = runtime.store.cancel_requests(conn, owner=runtime.worker_id, ids=held)
        return runtime.request_cancel(requested) if requested else 0

    def rescue(self) -> RescueResult:
        """Release (or quarantine) processing messages whose worker stopped heartbeating."""
        broker = self.runtime.broker
        with self.runtime.connection() as conn:
            counts = self.runtime.store.rescue(
                conn,
                worker_id=self.runtime.worker_id,
                heartbeat_timeout_ms=broker.options.heartbeat_timeout,
                max_lease_ms=broker.options.max_lease,
                max_deliveries=broker.options.max_deliveries,
                channel=self.runtime.channel,
            )
        metrics = broker._metrics
        if metrics is not None and (counts.released or counts.quarantined):
            metrics.rescued.inc(counts.released)
            metrics.quarantined.inc(counts.quarantined)
        return RescueResult(counts.released, counts.quarantined, counts.dead_workers, counts.canceled)

    def release_orphans(self, grace_ms: int = ORPHAN_GRACE_MS) -> int:
        """Release rows this process holds in the database but no longer in memory; how many.

        Those an operator canceled (a stopping consumer's requeue leaves them) are archived
        as canceled instead, and logged.
        """
        known = self.runtime.known_claims()
        with self.runtime.connection() as conn:
            released, canceled = self.runtime.store.release_orphans(
                conn, owner=self.runtime.worker_id, grace_ms=grace_ms, known_ids=known
            )
        if canceled:
            self.logger.warning("Archived %d canceled claim(s) of this process as canceled", canceled)
        return released
