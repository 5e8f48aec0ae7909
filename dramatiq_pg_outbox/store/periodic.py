"""The periodic store: the ``periodic_*`` statements of ``queries.sql`` (``periodic/scheduler.py``, the CLI).

A scheduler's rules travel as parallel arrays (:class:`Rules`): a schedule is
matched by its name and its rule (``cron``, ``every_ms``, ``tz``), so a scheduler
never claims a schedule that another one declared with a different rule.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg

from .base import SchemaStore, named_rows


class Rules(NamedTuple):
    """A scheduler's schedules as the parallel arrays of the statements, one element per schedule."""

    names: list[str]
    crons: list[str | None]
    every_ms: list[int | None]
    tzs: list[str]

    def params(self) -> dict[str, Any]:
        """The statements' parameters ``names``, ``crons``, ``every_ms``, ``tzs``."""
        return {"names": self.names, "crons": self.crons, "every_ms": self.every_ms, "tzs": self.tzs}


class Declared(NamedTuple):
    """A schedule :meth:`PeriodicStore.declare` wrote: new, its rule changed, or declared again."""

    name: str
    added: bool
    changed: bool
    revived: bool


class Removed(NamedTuple):
    """Schedules :meth:`PeriodicStore.remove` marked removed, and those it deleted."""

    removed: int
    deleted: int


class DueSchedule(NamedTuple):
    """A schedule claimed by :meth:`PeriodicStore.claim`: its next run and the database's ``now()``."""

    name: str
    next_run_at: dt.datetime
    now: dt.datetime


class ScheduleListRow(NamedTuple):
    """A row of ``periodic_list`` (the ``schedules`` command): active schedules first, by name."""

    name: str
    actor_name: str
    queue_name: str
    cron: str | None
    every_ms: int | None
    tz: str
    missed: str
    grace_ms: int
    last_run_at: dt.datetime | None
    next_run_at: dt.datetime
    runs: int
    missed_ticks: int
    #: Seconds since ``next_run_at`` (negative: not due yet).
    late_s: float
    #: Seconds since it was marked removed, or None.
    removed_s: float | None
    disabled_at: dt.datetime | None


class PeriodicStore(SchemaStore):
    """The statements of the periodic scheduler (see :class:`~.base.SchemaStore`)."""

    def begin(self, conn: psycopg.Connection[Any], *, idle_timeout: int) -> dt.datetime:
        """Bound the idle time of ``conn``'s transaction to ``idle_timeout`` ms; return its ``now()``."""
        row = conn.execute(self.queries["periodic_begin"], {"idle_timeout": idle_timeout}).fetchone()
        assert row is not None
        now: dt.datetime = row[0]
        return now

    def declare(
        self,
        conn: psycopg.Connection[Any],
        *,
        rules: Rules,
        actor_names: Sequence[str],
        queue_names: Sequence[str],
        missed: Sequence[str],
        grace_ms: Sequence[int],
        first_runs: Sequence[dt.datetime],
        define: bool,
        stale: dt.datetime,
    ) -> list[Declared]:
        """Write (``define``) or refresh the schedules of ``rules``; one row per schedule written.

        Parameters:
          actor_names, queue_names, missed, grace_ms, first_runs: One per schedule of ``rules``.
          define(bool): Write the definitions; False only marks those whose rule matches as seen.
          stale(datetime): A schedule not seen since then takes this scheduler's definition.
        """
        params = {
            **rules.params(),
            "actor_names": list(actor_names),
            "queue_names": list(queue_names),
            "missed": list(missed),
            "grace_ms": list(grace_ms),
            "first_runs": list(first_runs),
            "define": define,
            "stale": stale,
        }
        cur = conn.cursor(row_factory=named_rows(Declared))
        return cur.execute(self.queries["periodic_declare"], params).fetchall()

    def remove(self, conn: psycopg.Connection[Any], *, removed_after: int, retention: int) -> Removed:
        """Mark schedules unseen for ``removed_after`` ms removed; delete those gone ``retention`` ms."""
        params = {"removed_after": removed_after, "retention": retention}
        row = conn.execute(self.queries["periodic_remove"], params).fetchone()
        assert row is not None
        return Removed(int(row[0]), int(row[1]))

    def claim(self, conn: psycopg.Connection[Any], *, rules: Rules, limit: int) -> list[DueSchedule]:
        """Lock up to ``limit`` due schedules of ``rules`` (others' locked ones skipped), earliest first."""
        cur = conn.cursor(row_factory=named_rows(DueSchedule))
        return cur.execute(self.queries["periodic_claim"], {**rules.params(), "limit": limit}).fetchall()

    def advance(
        self,
        conn: psycopg.Connection[Any],
        *,
        names: Sequence[str],
        next_runs: Sequence[dt.datetime],
        last_runs: Sequence[dt.datetime | None],
        runs: Sequence[int],
        missed: Sequence[int],
    ) -> None:
        """Move each schedule of ``names`` to its next run, counting the ticks enqueued and missed."""
        params = {
            "names": list(names),
            "next_runs": list(next_runs),
            "last_runs": list(last_runs),
            "runs": list(runs),
            "missed": list(missed),
        }
        conn.execute(self.queries["periodic_advance"], params)

    def next_due_in(self, conn: psycopg.Connection[Any], *, rules: Rules) -> float | None:
        """Milliseconds until the earliest next run of the schedules of ``rules`` (None: none)."""
        row = conn.execute(self.queries["periodic_next_due"], rules.params()).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def list_schedules(self, conn: psycopg.Connection[Any]) -> list[ScheduleListRow]:
        """Every schedule of the schema, active ones first, then by name."""
        cur = conn.cursor(row_factory=named_rows(ScheduleListRow))
        return cur.execute(self.queries["periodic_list"]).fetchall()
