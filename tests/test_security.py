"""docs/security.md, executed: the least-privilege roles run the broker, and no more.

The SQL blocks are read from the document itself, so the documentation and
this test cannot drift apart.  Roles are cluster-wide: their names get a
random suffix (two test runs on one server do not collide) and they are
dropped at the end, after the test's own database.
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import Message
from psycopg import sql
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox, upgrade
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.names import channel_for
from dramatiq_pg_outbox.spark import Plan, write_partition
from dramatiq_pg_outbox.testing import scratch_database
from tests.helpers import count, wait_for

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
ROLES = ("owner", "producer", "worker", "spark", "monitor")
#: Messages left on the queue of tests/worker_app.py.
DEFAULT_QUEUE_SIZE = "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'default'"
#: worker_app.py's default max_deliveries.
WORKER_APP_MAX_DELIVERIES = 3


def doc_sql_blocks() -> list[tuple[str, str]]:
    """(who runs it, SQL) for each ```sql block of docs/security.md, in order."""
    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    found = []
    for block in blocks:
        header = re.match(r"-- run as: (.+)\n", block)
        assert header, f"a SQL block of {DOC.name} does not start with '-- run as: <role>':\n{block}"
        found.append((header.group(1).strip(), block))
    return found


@dataclass
class Secured:
    """A database set up as docs/security.md says, with one URL per role."""

    admin_url: str
    urls: dict[str, str]
    roles: dict[str, str]

    def localize(self, text: str) -> str:
        """``text`` with the document's role names replaced by this run's."""
        return re.sub(
            r"\bdramatiq_(owner|producer|worker|spark|monitor)\b", lambda m: self.roles[m.group(1)], text
        )

    def connect(self, role: str) -> psycopg.Connection[Any]:
        return psycopg.connect(self.urls[role], autocommit=True)


@pytest.fixture(scope="module")
def secured(admin_url: str) -> Iterator[Secured]:
    suffix = secrets.token_hex(4)
    roles = {role: f"dramatiq_{role}_{suffix}" for role in ROLES}
    password = secrets.token_hex(16)
    localize = Secured("", {}, roles).localize
    try:
        with scratch_database(admin_url, "dpo_security") as db_url:
            blocks = doc_sql_blocks()
            assert [who for who, _ in blocks] == ["a superuser", "dramatiq_owner"]
            # Given: the roles and the schema, created by a superuser as the document says
            with psycopg.connect(db_url, autocommit=True) as admin:
                admin.execute(localize(blocks[0][1]))
                for name in roles.values():
                    admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(name), password))
                # The actors' own table (tests/worker_app.py): the application grants it.
                admin.execute(
                    "CREATE TABLE received (key text PRIMARY KEY, n int NOT NULL, pids int[] NOT NULL);"
                    f"GRANT SELECT, INSERT, UPDATE ON received TO {roles['worker']}"
                )
            base = make_url(db_url)
            urls = {
                role: base.set(username=name, password=password).render_as_string(hide_password=False)
                for role, name in roles.items()
            }
            # And: the tables, migrated by the owner role, then the owner's GRANTs
            upgrade(urls["owner"])
            with psycopg.connect(urls["owner"], autocommit=True) as owner:
                owner.execute(localize(blocks[1][1]))
            yield Secured(admin_url=db_url, urls=urls, roles=roles)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            for name in roles.values():
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def test_the_owner_role_migrates_again_and_regrants_idempotently(secured: Secured) -> None:
    # When: a later deploy runs migrate and the owner's block again
    upgrade(secured.urls["owner"])
    with secured.connect("owner") as owner:
        owner.execute(secured.localize(doc_sql_blocks()[1][1]))
        # Then: the tables are at the newest revision
        assert count(owner, "SELECT count(*) FROM dramatiq.dramatiq_pg_outbox_version") == 1


def record_message(key: str | None) -> Message[Any]:
    """A message for tests/worker_app.py's ``record`` actor (without a key, the actor raises TypeError)."""
    args = () if key is None else (key,)
    return Message(queue_name="default", actor_name="record", args=args, kwargs={}, options={})


@pytest.mark.slow
def test_a_worker_runs_with_the_worker_role_alone(secured: Secured, worker_process: Any) -> None:
    admin = psycopg.connect(secured.admin_url, autocommit=True)
    # Given: two claims held by a worker process that died: one to release, one that used up its deliveries
    for key, attempts in (("stuck", 1), ("poison", WORKER_APP_MAX_DELIVERIES)):
        admin.execute(
            "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload, state, "
            "attempts, lease, owner, acquired_at) "
            "VALUES ('default', 'record', %s, %s, 'processing', %s, %s, %s, now())",
            (str(uuid.uuid4()), record_message(key).encode(), attempts, uuid.uuid4(), uuid.uuid4()),
        )
    # And: a dramatiq worker process connected as the worker role; it polls every 10 minutes
    # only, so prompt deliveries also show that its LISTEN works
    worker = worker_process(
        processes=1,
        threads=2,
        env={"DPO_TEST_URL": secured.urls["worker"], "DPO_MAX_FETCH_INTERVAL": "600000"},
    )
    producer = PostgresBroker(url=secured.urls["producer"])

    @dramatiq.actor(broker=producer, actor_name="record", max_retries=0)
    def record(key: str) -> None:
        raise AssertionError("runs in the worker process only")

    engine = create_engine(normalize_sqlalchemy_url(secured.urls["producer"]))
    try:
        wait_for(lambda: count(admin, "SELECT count(*) FROM dramatiq.workers") >= 1, 60, "a heartbeat row")
        # When: the producer role sends through the pool, through outbox() and with an idempotency key
        record.send("pool")
        with Session(engine) as session, outbox(session, broker=producer):
            record.send("outbox")
            session.commit()
        record.send_with_options(args=("keyed",), idempotency_key="keyed-1")
        producer.enqueue(record_message(None))  # the actor raises TypeError: a dead letter
        # Then: the worker processed, acked (archived) and dead-lettered them, and rescued the dead claims
        wait_for(lambda: count(admin, DEFAULT_QUEUE_SIZE) == 0, 60, "an empty queue")
        received = dict(admin.execute("SELECT key, n FROM received").fetchall())
        assert received == {"pool": 1, "outbox": 1, "keyed": 1, "stuck": 1}
        history = admin.execute(
            "SELECT state, error_type, count(*) FROM dramatiq.history WHERE queue_name = 'default' "
            "GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()
        assert history == [
            ("completed", None, 4),
            ("failed", "MaxDeliveriesExceeded", 1),
            ("failed", "TypeError", 1),
        ]
        # And: a second send with a processed key adds nothing (the producer reads history's keys)
        record.send_with_options(args=("keyed",), idempotency_key="keyed-1")
        assert count(admin, DEFAULT_QUEUE_SIZE) == 0
        # When: the worker stops
        assert worker.stop() == 0
        # Then: it unregistered itself
        assert count(admin, "SELECT count(*) FROM dramatiq.workers") == 0
    finally:
        producer.close()
        engine.dispose()
        admin.close()


def test_the_spark_role_writes_a_partition_idempotently(secured: Secured) -> None:
    plan = Plan.build(
        key="key",
        args=("key",),
        conninfo=secured.urls["spark"],
        schema="dramatiq",
        channel=channel_for("dramatiq"),
        queue_name="spark_only",
        actor_name="record",
        batch_id=f"batch-{uuid.uuid4()}",
        options={},
        delay_ms=0,
        notify=True,
        encoder=dramatiq.get_encoder(),
    )
    assert write_partition(plan, [("a",), ("b",)]) == (2, 2, 0)
    assert write_partition(plan, [("a",), ("b",), ("c",)]) == (3, 1, 0)


def test_the_spark_role_may_run_the_actor_check(secured: Secured) -> None:
    from dramatiq_pg_outbox.spark import UnknownActor
    from dramatiq_pg_outbox.spark.options import check_actor

    # The grant of docs/security.md is enough to read the live workers (none here)
    with psycopg.connect(secured.admin_url, autocommit=True) as admin:
        admin.execute("DELETE FROM dramatiq.workers")  # another test's worker may be alive
    with psycopg.connect(secured.urls["spark"], autocommit=True) as conn:
        with pytest.raises(UnknownActor, match="no live worker: no worker process heartbeated"):
            check_actor(conn, "dramatiq", "record", "default", "check_actor=False")


def test_the_backlog_reader_needs_only_the_columns_its_readme_grants(secured: Secured) -> None:
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[dev]')")
    from dramatiq_pg_outbox.spark.backlog import BacklogReader as BacklogReader
    from dramatiq_pg_outbox.spark.backlog import scan_from_options

    # Given the column grant of examples/spark_pipeline/README.md ("The backlog as a table")
    examples = Path(__file__).resolve().parent.parent / "examples"
    readme = (examples / "spark_pipeline" / "README.md").read_text()
    grant = re.search(r"`(GRANT SELECT \(id, queue_name.*?TO dramatiq_monitor)`", readme, re.DOTALL)
    assert grant is not None
    with secured.connect("owner") as owner:
        owner.execute(secured.localize(" ".join(grant.group(1).split())))
    with secured.connect("producer") as producer:
        producer.execute(
            "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload) "
            "VALUES ('backlog_only', 'record', 'm1', '\\x'::bytea)"
        )
    # When the monitor role reads the backlog as the reader's tasks do (without Spark)
    reader = BacklogReader(scan_from_options({"url": secured.urls["monitor"], "partitions": "2"}))
    rows = [row for part in reader.partitions() for row in reader.read(part)]
    # Then it reads the messages, and still no payload
    assert [(r[1], r[3], r[4]) for r in rows if r[1] == "backlog_only"] == [("backlog_only", "m1", "pending")]
    with secured.connect("monitor") as monitor, pytest.raises(psycopg.errors.InsufficientPrivilege):
        monitor.execute("SELECT payload FROM dramatiq.messages")


def test_the_outbox_relay_runs_with_the_worker_role_alone(secured: Secured) -> None:
    redis = pytest.importorskip("redis", reason="the relay test needs redis (pip install 'dramatiq[redis]')")
    from dramatiq.brokers.redis import RedisBroker

    from dramatiq_pg_outbox.relay import Relay

    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/0").ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis server at 127.0.0.1:6379")
    queue, namespace = f"relayed_{uuid.uuid4().hex[:8]}", f"dpo-security-{uuid.uuid4().hex[:8]}"
    producer = PostgresBroker(url=secured.urls["producer"])
    broker = PostgresBroker(url=secured.urls["worker"])
    target = RedisBroker(url="redis://127.0.0.1:6379/0", namespace=namespace)
    try:
        # Given: two messages of a relayed queue, sent by the producer role
        producer.enqueue_many([record_message(f"r{i}").copy(queue_name=queue) for i in range(2)])
        # When: a relay connected as the worker role moves them (claim, publish, archive)
        assert Relay(broker, target, [queue]).run_once() == 2
        # Then: they are in Redis and archived as completed
        assert target.client.hlen(f"{namespace}:{queue}.msgs") == 2
        with secured.connect("owner") as owner:
            assert count(owner, "SELECT count(*) FROM dramatiq.history WHERE queue_name = %s", (queue,)) == 2
    finally:
        producer.close()
        broker.close()
        for key in target.client.scan_iter(f"{namespace}*"):
            target.client.delete(key)
        target.close()


MONITOR_READS = [
    "SELECT count(*) FROM dramatiq.message_stats_by_minute",
    "SELECT count(*) FROM dramatiq.message_stats_by_hour",
    "SELECT count(*) FROM dramatiq.message_stats(interval '1 hour')",
    "SELECT count(*) FROM dramatiq.message_attempts",
    "SELECT count(*) FROM dramatiq.message_errors",
    "SELECT count(*) FROM dramatiq.queue_backlog",
]


@pytest.mark.parametrize("query", MONITOR_READS)
def test_the_monitor_role_reads_the_analytics_views(secured: Secured, query: str) -> None:
    with secured.connect("monitor") as conn:
        assert conn.execute(query).fetchone() is not None


DENIED = [
    # (role, statement): what docs/security.md says each role cannot do
    ("producer", "SELECT payload FROM dramatiq.messages"),
    ("producer", "SELECT payload FROM dramatiq.history"),
    ("producer", "UPDATE dramatiq.messages SET payload = payload"),
    ("producer", "DELETE FROM dramatiq.messages"),
    (
        "producer",
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, "
        "payload) VALUES (-1, 'q', 'a', 'm', 'failed', 1, now(), '')",
    ),
    ("producer", "SELECT * FROM dramatiq.workers"),
    ("worker", "SELECT payload FROM dramatiq.history"),
    ("worker", "SELECT error FROM dramatiq.history"),
    ("worker", "UPDATE dramatiq.history SET payload = payload"),
    ("worker", "DELETE FROM dramatiq.history"),
    ("worker", "UPDATE dramatiq.messages SET payload = payload"),
    ("worker", "CREATE TABLE dramatiq.intruder (a int)"),
    ("spark", "SELECT payload FROM dramatiq.messages"),
    ("spark", "SELECT payload FROM dramatiq.history"),
    ("spark", "DELETE FROM dramatiq.messages"),
    ("producer", "DELETE FROM dramatiq.idempotency_keys"),
    ("worker", "DELETE FROM dramatiq.idempotency_keys"),
    ("monitor", "SELECT payload FROM dramatiq.history"),
    ("monitor", "SELECT error FROM dramatiq.history"),
    ("monitor", "SELECT payload FROM dramatiq.messages"),
    (
        "monitor",
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload) "
        "VALUES ('q', 'a', 'm', '')",
    ),
    ("owner", "CREATE SCHEMA intruder"),
]


@pytest.mark.parametrize(("role", "statement"), DENIED, ids=[f"{r}: {s[:40]}" for r, s in DENIED])
def test_each_role_is_refused_what_the_document_says_it_cannot_do(
    secured: Secured, role: str, statement: str
) -> None:
    with secured.connect(role) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(statement)
