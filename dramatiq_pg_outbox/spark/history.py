"""The ``dramatiq_history`` Spark data source: ``spark.read.format("dramatiq_history")``.

Usage (PySpark 4's Python Data Source API)::

    from dramatiq_pg_outbox.spark import register

    register(spark)
    history = (spark.read.format("dramatiq_history")
        .option("url", "postgresql://app@db/app")
        .option("since", "2026-11-01")           # optional, a UTC date or epoch ms
        .option("until", "2026-12-01")           # optional, exclusive
        .option("read_url", "postgresql://app@standby/app")  # optional: read on a hot standby
        .load())
    history.filter("queue_name = 'emails' AND state = 'failed'").groupBy("error_type").count()

Columns: ``id long, queue_name string, actor_name string, message_id string, state string,
attempts int, error_type string, enqueued_ms long, started_ms long, finished_ms long``
(times in epoch milliseconds, UTC; no payloads, no error texts).

Partitions: one Spark partition per UTC day that may hold rows (each day partition of
``history``, migration 0007, and the days found in ``history_default``), within the time
range, so a month of analytics reads that month's partitions and nothing else.

Filter pushdown: none on PySpark 4.3, whatever ``spark.sql.python.filterPushdown.enabled``
says.  Spark 4.3 keeps the read that one query's pushed filters planned (the reader and its
partitions) on the loaded DataFrame and runs it again for that DataFrame's next query that
pushes nothing: ``h.count()`` after ``h.filter(...).count()`` would count the filtered rows
(issue 34).  Spark applies every filter itself instead; to read fewer days, use the ``since``
and ``until`` options, which belong to the loaded DataFrame and hold for each of its queries.
:func:`register` chooses a reader that pushes comparisons of ``finished_ms`` with a number
and equality or ``IN`` on ``queue_name``, ``actor_name`` and ``state`` to PostgreSQL only on
a Spark that keeps each query's pushed read with that query's scan
(:func:`spark_scopes_pushdown_per_scan`, false on 4.3) and with the setting on when it runs;
it logs one line saying which (a WARNING when the setting is on and nothing is pushed).
Changing the setting afterwards has no effect until ``register(spark)`` runs again.
``df.explain("formatted")`` shows what was pushed: a ``PushedFilters: [...]`` line under
``BatchScan dramatiq_history`` (no such line when nothing is, as on 4.3).

Days: Spark may run the partitions planned for one query of a loaded DataFrame again for its
later queries, so a day created since may be missing from them; ``load()`` again to see it.

Reading from a standby: with ``read_url`` (a hot standby of ``url``'s server), the days and
the rows are read there, and ``url`` is only asked, when the read is planned, how far behind
the standby is: the driver logs one line (logger ``dramatiq_pg_outbox.spark.history``, INFO;
a WARNING when it is behind or the primary was not reached) with the standby's lag
(:class:`~dramatiq_pg_outbox.store.admin.ReadLag`: 0 s when it has replayed all the primary's
WAL).  The rows are those the standby had replayed when each partition was read.

Raises: ``ValueError`` naming the option for a missing ``url``, an unknown option or a bad
``since``, ``until``, ``schema`` or ``read_url``.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)

from ..store.spark import SparkStore
from .options import connect, given_options, log_read_lag, url_option

SCHEMA = (
    "id long, queue_name string, actor_name string, message_id string, state string, attempts int, "
    "error_type string, enqueued_ms long, started_ms long, finished_ms long"
)
OPTIONS = ("url", "schema", "since", "until", "read_url")
#: Columns whose equality and IN filters are pushed, and the query parameter of each.
_PUSHED_COLUMNS = {"queue_name": "queues", "actor_name": "actors", "state": "states"}
_DAY_MS = 86_400_000
#: Unbounded ends of the time range, in epoch ms (PostgreSQL's to_timestamp takes them).
_MIN_MS, _MAX_MS = -(2**53), 2**53
#: The JVM class whose fields tell whether Spark keeps a pushed read with its own scan.
_SCAN_BUILDER = "org.apache.spark.sql.execution.datasources.v2.python.PythonScanBuilder"

logger = logging.getLogger(__name__)


@dataclass
class _Day(InputPartition):
    """One Spark partition: the rows finished in [lo, hi) epoch ms."""

    lo: int
    hi: int


@dataclass
class _Scan:
    """What one read asks for: the options, then what pushed filters narrowed."""

    #: Where the days and rows are read: ``read_url``'s libpq URL if given, else ``url``'s.
    conninfo: str = field(repr=False)
    schema: str
    #: ``url``'s libpq URL when ``read_url`` is given (asked for the standby's lag only), else None.
    primary: str | None = field(default=None, repr=False)
    lo: int = _MIN_MS
    hi: int = _MAX_MS
    values: dict[str, set[str] | None] = field(default_factory=lambda: dict.fromkeys(_PUSHED_COLUMNS))


class HistoryDataSource(DataSource):
    """``format("dramatiq_history")`` without filter pushdown (see the module's documentation)."""

    @classmethod
    def name(cls) -> str:
        return "dramatiq_history"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return HistoryReader(scan_from_options(self.options))


class PushingHistoryDataSource(HistoryDataSource):
    """``format("dramatiq_history")`` with filter pushdown.

    Correct only on a Spark that keeps each query's pushed read with that query's scan:
    :func:`register` chooses it only there.  Spark refuses its reader while
    ``spark.sql.python.filterPushdown.enabled`` is off.
    """

    def reader(self, schema: Any) -> DataSourceReader:
        return _PushingReader(scan_from_options(self.options))


class HistoryReader(DataSourceReader):
    def __init__(self, scan: _Scan) -> None:
        self.scan = scan

    def partitions(self) -> list[_Day]:
        with connect(self.scan.conninfo) as conn:
            days = SparkStore(self.scan.schema).history_days(conn)
            if self.scan.primary is not None:
                log_read_lag(conn, self.scan.primary, "dramatiq_history", logger)
        epoch = datetime.date(1970, 1, 1)
        parts = []
        for day in days:
            start = (day - epoch).days * _DAY_MS
            lo, hi = max(start, self.scan.lo), min(start + _DAY_MS, self.scan.hi)
            if lo < hi:
                parts.append(_Day(lo, hi))
        # Spark needs one partition at least; an empty range reads nothing.
        return parts or [_Day(0, 0)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Day)
        if partition.lo >= partition.hi:
            return
        values: dict[str, list[str] | None] = {}
        for column, name in _PUSHED_COLUMNS.items():
            allowed = self.scan.values[column]
            values[name] = None if allowed is None else sorted(allowed)
        with connect(self.scan.conninfo) as conn:
            with conn.cursor(name="dpo_history") as cur:
                cur.itersize = 10_000
                SparkStore(self.scan.schema).history_range_rows(
                    cur,
                    lo=partition.lo,
                    hi=partition.hi,
                    queues=values["queues"],
                    actors=values["actors"],
                    states=values["states"],
                )
                yield from cur


class _PushingReader(HistoryReader):
    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        for f in filters:
            if not self._push(f):
                yield f

    def _push(self, f: Filter) -> bool:
        """Apply one filter to the scan if PostgreSQL can apply it exactly; whether it did."""
        attribute: tuple[str, ...] = getattr(f, "attribute", ())
        column = attribute[0] if len(attribute) == 1 else None
        value = getattr(f, "value", None)
        if column == "finished_ms" and isinstance(value, int) and not isinstance(value, bool):
            scan = self.scan
            if isinstance(f, GreaterThan):
                scan.lo = max(scan.lo, value + 1)
            elif isinstance(f, GreaterThanOrEqual):
                scan.lo = max(scan.lo, value)
            elif isinstance(f, LessThan):
                scan.hi = min(scan.hi, value)
            elif isinstance(f, LessThanOrEqual):
                scan.hi = min(scan.hi, value + 1)
            elif isinstance(f, EqualTo):
                scan.lo, scan.hi = max(scan.lo, value), min(scan.hi, value + 1)
            else:
                return False
            return True
        if column in _PUSHED_COLUMNS:
            if isinstance(f, EqualTo) and isinstance(value, str):
                wanted = {value}
            elif isinstance(f, In) and all(isinstance(v, str) for v in f.value):
                wanted = set(f.value)
            else:
                return False
            allowed = self.scan.values[column]
            self.scan.values[column] = wanted if allowed is None else allowed & wanted
            return True
        return False


def _epoch_ms(option: str, text: str) -> int:
    """A time option: epoch milliseconds, or an ISO date or time (UTC unless it says otherwise)."""
    if text.strip().lstrip("-").isdigit():
        return int(text)
    try:
        moment = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"option {option!r} is epoch milliseconds or an ISO date or time (2026-11-01, "
            f"2026-11-01T12:00:00+00:00), not {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return int(moment.timestamp() * 1000)


def scan_from_options(options: Mapping[str, str]) -> _Scan:
    """The scan the options ask for.

    Raises:
      ValueError: Naming the option: ``url`` missing or not PostgreSQL, an unknown option,
        a bad ``schema``, ``since`` or ``until``.
    """
    given, conninfo, schema = given_options(options, "dramatiq_history", OPTIONS, ("url",))
    scan = _Scan(conninfo=conninfo, schema=schema)
    if given.get("read_url"):
        scan.conninfo, scan.primary = url_option(given, "read_url"), conninfo
    if "since" in given:
        scan.lo = _epoch_ms("since", given["since"])
    if "until" in given:
        scan.hi = _epoch_ms("until", given["until"])
    return scan


def spark_scopes_pushdown_per_scan(spark: Any) -> bool:
    """Whether ``spark`` (a SparkSession) keeps the read planned by pushed filters with its scan.

    PySpark 4.3 keeps it on the loaded DataFrame instead (``PythonDataSourceV2.setReadInfo``),
    where the DataFrame's next query that pushes nothing reads it again: pushing filters there
    returns wrong rows.  A Spark whose ``PythonScanBuilder`` holds the read itself (a
    ``readInfo`` field) plans it per scan.  False when the JVM cannot be asked (Spark Connect).
    """
    try:
        builder = spark._jvm.java.lang.Class.forName(_SCAN_BUILDER)
        return any(f.getName() == "readInfo" for f in builder.getDeclaredFields())
    except Exception:
        return False


def register(spark: Any) -> None:
    """Register ``format("dramatiq_history")`` with ``spark`` (a SparkSession), replacing any.

    Filters are pushed to PostgreSQL only if ``spark.sql.python.filterPushdown.enabled`` is on
    now and :func:`spark_scopes_pushdown_per_scan` (never on PySpark 4.3); otherwise Spark
    applies every filter.  Logs one line (logger ``dramatiq_pg_outbox.spark.history``) saying
    which: a WARNING when the setting is on but filters are not pushed, else INFO.  The
    setting is read here: changing it later has no effect until ``register(spark)`` runs again.
    """
    enabled = str(spark.conf.get("spark.sql.python.filterPushdown.enabled", "false")).lower() == "true"
    scoped = spark_scopes_pushdown_per_scan(spark)
    spark.dataSource.register(PushingHistoryDataSource if enabled and scoped else HistoryDataSource)
    if enabled and scoped:
        logger.info(
            "format('dramatiq_history') pushes filters on finished_ms, queue_name, actor_name and state"
        )
    elif enabled:
        logger.warning(
            "format('dramatiq_history') pushes no filter: this Spark reruns one query's pushed read for "
            "the next query of the same DataFrame; narrow reads with the since/until options"
        )
    else:
        logger.info(
            "format('dramatiq_history') pushes no filter: spark.sql.python.filterPushdown.enabled is off "
            "(it is read by register(spark), not later)"
        )
