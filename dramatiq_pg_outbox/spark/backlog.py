"""The ``dramatiq_backlog`` Spark data source: ``spark.read.format("dramatiq_backlog")``.

Usage (PySpark 4's Python Data Source API)::

    from dramatiq_pg_outbox.spark import register

    register(spark)
    backlog = (spark.read.format("dramatiq_backlog")
        .option("url", "postgresql://app@db/app")
        .option("partitions", 8)                 # optional, default 4
        .option("read_url", "postgresql://app@standby/app")  # optional: read on a hot standby
        .load())
    backlog.groupBy("queue_name", "state").count()

Columns: ``id long, queue_name string, actor_name string, message_id string, state string,
attempts int, priority int, enqueued_ms long, next_attempt_ms long, acquired_ms long,
idempotency_key string`` (times in epoch milliseconds, UTC; ``state`` is ``pending`` or
``processing``; ``acquired_ms`` is null unless the message is being processed; no payloads).

Partitions: the id range of the live messages (its minimum and maximum when the reader is
planned) cut into ``partitions`` slices of equal width, one Spark partition each, read with
one connection per running task; the first slice has no lower bound and the last no upper
one.  The messages table is live: each slice is read in its own transaction, so the table is
not read at one instant; one finished meanwhile may be missing, none is read twice.  PySpark
4.3 plans a loaded DataFrame's partitions once and runs them again for each later query on
it (see :mod:`~dramatiq_pg_outbox.spark.history`): the open last slice makes a later query
read the messages enqueued since (ids only grow), where a closed one would miss them.

Reading from a standby: with ``read_url`` (a hot standby of ``url``'s server), the id range
and the messages are read there, and the standby's lag is logged when the read is planned, as
:mod:`~dramatiq_pg_outbox.spark.history` does (logger ``dramatiq_pg_outbox.spark.backlog``).

Raises: ``ValueError`` naming the option for a missing ``url``, an unknown option or a bad
``schema``, ``partitions`` or ``read_url``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ..store.spark import SparkStore
from .options import connect, given_options, log_read_lag, url_option

SCHEMA = (
    "id long, queue_name string, actor_name string, message_id string, state string, attempts int, "
    "priority int, enqueued_ms long, next_attempt_ms long, acquired_ms long, idempotency_key string"
)
OPTIONS = ("url", "schema", "partitions", "read_url")
#: The bounds of a bigint id: the first and the last slice are open (see the module's documentation).
MIN_ID, MAX_ID = -(2**63), 2**63 - 1
#: Slices of the id range when the ``partitions`` option is not given.
DEFAULT_PARTITIONS = 4

logger = logging.getLogger(__name__)


@dataclass
class _Slice(InputPartition):
    """One Spark partition: the messages whose id is in [lo, hi)."""

    lo: int
    hi: int


@dataclass
class _Scan:
    #: Where the messages are read: ``read_url``'s libpq URL if given, else ``url``'s.
    conninfo: str = field(repr=False)
    schema: str
    partitions: int
    #: ``url``'s libpq URL when ``read_url`` is given (asked for the standby's lag only), else None.
    primary: str | None = field(default=None, repr=False)


class BacklogDataSource(DataSource):
    """``format("dramatiq_backlog")``: the live messages (see the module's documentation)."""

    @classmethod
    def name(cls) -> str:
        return "dramatiq_backlog"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return BacklogReader(scan_from_options(self.options))


class BacklogReader(DataSourceReader):
    def __init__(self, scan: _Scan) -> None:
        self.scan = scan

    def partitions(self) -> list[_Slice]:
        with connect(self.scan.conninfo) as conn:
            ids = SparkStore(self.scan.schema).backlog_id_range(conn)
            if self.scan.primary is not None:
                log_read_lag(conn, self.scan.primary, "dramatiq_backlog", logger)
        if ids is None:
            return [_Slice(MIN_ID, MAX_ID)]  # empty now; a later run of this plan reads what came
        found = slices(ids.lo, ids.hi + 1, self.scan.partitions)
        # Open at both ends: a rerun of this plan (a later query on the loaded DataFrame)
        # reads what was enqueued since, in the last slice.
        found[0].lo, found[-1].hi = MIN_ID, MAX_ID
        return found

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Slice)
        if partition.lo >= partition.hi:
            return
        with connect(self.scan.conninfo) as conn:
            with conn.cursor(name="dpo_backlog") as cur:
                cur.itersize = 10_000
                SparkStore(self.scan.schema).backlog_range_messages(cur, lo=partition.lo, hi=partition.hi)
                yield from cur


def slices(lo: int, hi: int, parts: int) -> list[_Slice]:
    """[lo, hi) cut into at most ``parts`` contiguous slices of (nearly) equal width."""
    parts = max(1, min(parts, hi - lo))
    width, extra = divmod(hi - lo, parts)
    out, start = [], lo
    for i in range(parts):
        end = start + width + (1 if i < extra else 0)
        out.append(_Slice(start, end))
        start = end
    return out


def scan_from_options(options: Mapping[str, str]) -> _Scan:
    """The scan the options ask for.

    Raises:
      ValueError: Naming the option: ``url`` missing or not PostgreSQL, an unknown option,
        a bad ``schema``, ``partitions`` not a whole number from 1.
    """
    given, conninfo, schema = given_options(options, "dramatiq_backlog", OPTIONS, ("url",))
    text = given.get("partitions", str(DEFAULT_PARTITIONS))
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"option 'partitions' is a whole number from 1, not {text!r}")
    scan = _Scan(conninfo=conninfo, schema=schema, partitions=int(text))
    if given.get("read_url"):
        scan.conninfo, scan.primary = url_option(given, "read_url"), conninfo
    return scan


def register(spark: Any) -> None:
    """Register ``format("dramatiq_backlog")`` with ``spark`` (a SparkSession)."""
    spark.dataSource.register(BacklogDataSource)
