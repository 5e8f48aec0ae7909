"""The day partitions of ``history`` (migration 0007): create them ahead, drop them to prune.

``history`` is partitioned by range of ``finished_at``, one partition per UTC
day (``history_pYYYYMMDD``) plus ``history_default``.  :func:`create_partitions`
makes the days ahead (the workers' maintenance loop calls it hourly; so does
``dramatiq-pg-outbox maintain``); :func:`prune` drops every day partition
entirely older than the cutoff, which costs the same for ten rows or ten
million, and deletes the older rows of the partition at the cutoff and of the
default partition.

Locks: dropping a partition takes an ACCESS EXCLUSIVE lock on ``history`` for a
moment.  Behind a long query on ``history`` (an analytics report) the DROP would
wait, and every archiving worker would queue behind it; so each DROP runs in its
own transaction with ``lock_timeout`` (default 2,000 ms) and is retried
(default 3 times), and a partition that could not be dropped is reported and
left for the next run.  ``DETACH PARTITION ... CONCURRENTLY`` would avoid the
lock but PostgreSQL refuses it on a table with a default partition.

The layout follows PostgreSQL's own documentation of declarative partitioning
("5.11.4. Partition Maintenance"); no extension such as pg_partman is used.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from .store.admin import AdminStore
from .store.messages import message_store

#: Days ahead that :func:`create_partitions` makes by default (today included as day 0).
DEFAULT_DAYS_AHEAD = 7
_DAY_PARTITION = re.compile(r"history_p(\d{8})")


@dataclass(frozen=True)
class Partition:
    """One day partition: its table name and its UTC day (rows with ``finished_at`` in ``[day, day + 1)``)."""

    name: str
    day: dt.date


@dataclass
class PruneResult:
    """What :func:`prune` did.

    Attributes:
      dropped(list[Partition]): Day partitions dropped.
      dropped_rows(int): Rows in them, from the planner's statistics (``reltuples``; an
        estimate: counting them would cost what dropping saves).
      deleted(int): Rows deleted one by one (the partition at the cutoff, the default one).
      kept(list[Partition]): Old partitions that could not be locked in time (left for next run).
      freed_keys(int): Idempotency keys freed: no row of messages or history holds them any more
        (a dry run counts those of no live message and no history row kept by the cutoff).
    """

    dropped: list[Partition] = field(default_factory=list)
    dropped_rows: int = 0
    deleted: int = 0
    kept: list[Partition] = field(default_factory=list)
    freed_keys: int = 0


def day_partitions(conn: psycopg.Connection[Any], schema: str) -> list[Partition]:
    """The day partitions of ``<schema>.history``, oldest first."""
    found = []
    for name in AdminStore(schema).day_partitions(conn):
        match = _DAY_PARTITION.fullmatch(name)
        if match:
            found.append(Partition(name, dt.datetime.strptime(match.group(1), "%Y%m%d").date()))
    return sorted(found, key=lambda p: p.day)


def create_partitions(conn: psycopg.Connection[Any], schema: str, days: int = DEFAULT_DAYS_AHEAD) -> int:
    """Create the day partitions of today (UTC) and of the next ``days`` days that are missing.

    Safe to call from any number of processes at once (the database function takes an
    advisory lock).  Needs EXECUTE on ``<schema>.create_history_partitions`` (the owner has
    it; grant it to the workers' role, docs/security.md).

    Returns:
      int: Partitions created.

    Raises:
      ValueError: If ``days`` is not within 0..3660.
      psycopg.errors.InsufficientPrivilege: Without EXECUTE on the function.
    """
    if not 0 <= days <= 3660:
        raise ValueError(f"days must be within 0..3660, not {days!r}")
    return message_store(schema).create_history_partitions(conn, days=days)


def prune(
    conn: psycopg.Connection[Any],
    schema: str,
    older_than: dt.timedelta,
    *,
    lock_timeout: int = 2_000,
    attempts: int = 3,
    dry_run: bool = False,
) -> PruneResult:
    """Remove the history rows that finished more than ``older_than`` ago, then free their keys.

    Last, in a statement of its own, the idempotency keys that no row of ``messages`` or
    ``history`` holds any more are deleted from ``idempotency_keys``: a send with one of
    them is stored again (docs/guarantees.md, "Idempotency keys").  A key whose history row
    is in a partition kept for the next run stays taken.

    Parameters:
      conn: An autocommit connection of the table's owner (dropping a partition needs it).
      schema(str): The schema of the tables.
      older_than(timedelta): Age of the oldest rows kept (positive).
      lock_timeout(int): Milliseconds a DROP may wait for its lock (default 2,000).
      attempts(int): Tries per partition before it is left for the next run (default 3).
      dry_run(bool): Change nothing; the result says what would be dropped (with the planner's
        row estimates) and counts the rows that would be deleted.  Default False.

    Returns:
      PruneResult: The partitions dropped (and kept), the rows deleted.

    Raises:
      ValueError: If ``older_than`` is not positive or ``conn`` is not in autocommit mode.
    """
    if older_than <= dt.timedelta(0):
        raise ValueError(f"older_than must be positive, not {older_than}")
    if not conn.autocommit:
        raise ValueError("prune needs an autocommit connection (each DROP is its own transaction)")
    store = AdminStore(schema)
    cutoff = store.prune_cutoff(conn, older_than=older_than)
    result = PruneResult()
    for partition in day_partitions(conn, schema):
        upper = dt.datetime.combine(partition.day + dt.timedelta(days=1), dt.time(), dt.timezone.utc)
        if upper > cutoff:
            break
        if dry_run:
            estimate = store.estimated_rows(conn, table=partition.name)
            result.dropped.append(partition)
            result.dropped_rows += estimate
            continue
        for attempt in range(attempts):
            try:
                with conn.transaction():
                    store.set_lock_timeout(conn, lock_timeout_ms=lock_timeout)
                    estimate = store.estimated_rows(conn, table=partition.name)
                    store.drop_partition(conn, partition=partition.name)
                result.dropped.append(partition)
                result.dropped_rows += estimate
                break
            except psycopg.errors.LockNotAvailable:
                if attempt + 1 == attempts:
                    result.kept.append(partition)
                else:
                    time.sleep(0.5 * (attempt + 1))
    # The rest, row by row: the default partition and the day partition of the cutoff
    # (not the kept ones: the next run drops them).
    at_cutoff = f"history_p{cutoff.astimezone(dt.timezone.utc):%Y%m%d}"
    for name in ("history_default", at_cutoff):
        if store.table_exists(conn, table=name):
            if dry_run:
                result.deleted += store.count_history_before(conn, partition=name, cutoff=cutoff)
                continue
            result.deleted += store.delete_history_before(conn, partition=name, cutoff=cutoff)
    if dry_run:
        result.freed_keys = store.count_idempotency_keys_before(conn, cutoff=cutoff)
    else:
        result.freed_keys = store.prune_idempotency_keys(conn)
    return result


__all__ = ["DEFAULT_DAYS_AHEAD", "Partition", "PruneResult", "create_partitions", "day_partitions", "prune"]
