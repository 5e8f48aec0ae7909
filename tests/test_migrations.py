"""Schema migrations: our own environment, an application's alembic history, the wheel."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from alembic.config import Config

from alembic import command
from dramatiq_pg_outbox import PostgresBroker, SchemaNotReady, downgrade, upgrade, versions_path
from dramatiq_pg_outbox.migrations import SCHEMA_REVISION

ROOT = Path(__file__).resolve().parent.parent


def tables(url: str, schema: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)).fetchall()
    return {r[0] for r in rows}


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_upgrade_creates_the_tables_in_a_chosen_schema_and_is_idempotent(database_url: str) -> None:
    drop_schema(database_url, "jobs")
    upgrade(database_url, schema="jobs")
    upgrade(database_url, schema="jobs")
    assert {"messages", "history", "workers", "dramatiq_pg_outbox_version"} <= tables(database_url, "jobs")
    downgrade(database_url, schema="jobs", revision="base")
    assert tables(database_url, "jobs") == {"dramatiq_pg_outbox_version"}
    drop_schema(database_url, "jobs")


def test_check_constraints_enforce_the_states(database_url: str, db: Any) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        db.execute(
            "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, state, payload) "
            "VALUES ('q', 'a', 'm', 'done', '')"
        )
    with pytest.raises(psycopg.errors.CheckViolation):
        db.execute(
            "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, "
            "enqueued_at, payload) VALUES (1, 'q', 'a', 'm', 'pending', 0, now(), '')"
        )


def test_the_cli_migrates(database_url: str) -> None:
    drop_schema(database_url, "cli_jobs")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dramatiq_pg_outbox.cli",
            "migrate",
            "--url",
            database_url,
            "--schema",
            "cli_jobs",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "cli_jobs" in out.stdout
    assert "messages" in tables(database_url, "cli_jobs")
    drop_schema(database_url, "cli_jobs")


def test_the_broker_names_the_fix_when_the_schema_is_missing(database_url: str) -> None:
    broker = PostgresBroker(url=database_url, schema="not_migrated")

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    with pytest.raises(SchemaNotReady, match="dramatiq-pg-outbox migrate"):
        task.send()
    broker.close()


def test_the_broker_refuses_an_old_schema(database_url: str) -> None:
    drop_schema(database_url, "old_jobs")
    upgrade(database_url, schema="old_jobs")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("COMMENT ON TABLE old_jobs.messages IS 'dramatiq-pg-outbox schema revision 0'")
    broker = PostgresBroker(url=database_url, schema="old_jobs")
    with pytest.raises(SchemaNotReady, match=f"needs {SCHEMA_REVISION}"):
        broker.queue_size("default")
    broker.close()
    drop_schema(database_url, "old_jobs")


def test_an_application_can_include_our_revisions_in_its_own_history(
    tmp_path: Path, database_url: str
) -> None:
    # Given an application's alembic environment with one revision of its own
    (tmp_path / "versions").mkdir()
    (tmp_path / "env.py").write_text(
        textwrap.dedent(
            """
            from alembic import context
            from sqlalchemy import create_engine
            engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
            with engine.begin() as conn:
                context.configure(connection=conn)
                with context.begin_transaction():
                    context.run_migrations()
            """
        )
    )
    (tmp_path / "versions" / "a1_users.py").write_text(
        textwrap.dedent(
            """
            from alembic import op
            revision = "a1"
            down_revision = None
            branch_labels = ("app",)
            depends_on = None
            def upgrade():
                op.execute("CREATE TABLE app_users (id int PRIMARY KEY)")
            def downgrade():
                op.execute("DROP TABLE app_users")
            """
        )
    )
    drop_schema(database_url, "app_jobs")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS app_users; DROP TABLE IF EXISTS alembic_version")
    cfg = Config()
    cfg.set_main_option("script_location", str(tmp_path))
    cfg.set_main_option("path_separator", "space")
    cfg.set_main_option("version_locations", f"{tmp_path / 'versions'} {versions_path()}")
    cfg.set_main_option("sqlalchemy.url", database_url.replace("postgresql://", "postgresql+psycopg://"))
    cfg.cmd_opts = type("Opts", (), {"x": ["dramatiq_pg_outbox_schema=app_jobs"]})()  # type: ignore[assignment]
    # When it upgrades all heads
    command.upgrade(cfg, "heads")
    # Then both histories are applied, tracked in the application's alembic_version
    assert "messages" in tables(database_url, "app_jobs")
    with psycopg.connect(database_url) as conn:
        heads = {r[0] for r in conn.execute("SELECT version_num FROM alembic_version")}
    assert "a1" in heads and len(heads) == 2
    broker = PostgresBroker(url=database_url, schema="app_jobs")
    assert broker.queue_size("default") == 0
    broker.close()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE app_users; DROP TABLE alembic_version")
    drop_schema(database_url, "app_jobs")


def test_the_wheel_ships_the_migrations_and_the_sql(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "dramatiq_pg_outbox/_alembic/env.py" in names
    assert "dramatiq_pg_outbox/_alembic/versions/0001_initial.py" in names
    assert "dramatiq_pg_outbox/queries.sql" in names
    assert "dramatiq_pg_outbox/py.typed" in names


def test_the_upgrade_to_0014_backfills_the_keys_and_the_downgrade_drops_them(database_url: str) -> None:
    # Given a schema at revision 0013 with keyed messages waiting and processed (one key in both:
    # stored twice before the keys table)
    drop_schema(database_url, "keys_jobs")
    upgrade(database_url, schema="keys_jobs", revision="0013")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO keys_jobs.messages (queue_name, actor_name, message_id, payload, idempotency_key,"
            " slot, enqueued_at) VALUES ('q', 'a', 'm1', '', 'waiting', -1, now()),"
            " ('q', 'a', 'm2', '', 'twice', -1, now()), ('q', 'a', 'm3', '', NULL, 0, now())"
        )
        conn.execute(
            "INSERT INTO keys_jobs.history (id, queue_name, actor_name, message_id, state, attempts,"
            " enqueued_at, payload, idempotency_key) VALUES"
            " (100, 'q', 'a', 'm4', 'completed', 1, '2026-01-02', '', 'done'),"
            " (101, 'q', 'a', 'm5', 'completed', 1, '2026-01-01', '', 'twice'),"
            " (102, 'q', 'a', 'm6', 'failed', 1, now(), '', NULL)"
        )
    try:
        # When it is upgraded to head
        upgrade(database_url, schema="keys_jobs")
        # Then every stored key has its row, dated by its first enqueue
        with psycopg.connect(database_url) as conn:
            rows = conn.execute(
                "SELECT idempotency_key, created_at::date::text FROM keys_jobs.idempotency_keys ORDER BY 1"
            ).fetchall()
        assert [key for key, _ in rows] == ["done", "twice", "waiting"]
        assert dict(rows)["done"] == "2026-01-02" and dict(rows)["twice"] == "2026-01-01"
        # And a send of a backfilled key is refused
        broker = PostgresBroker(url=database_url, schema="keys_jobs")

        @dramatiq.actor(broker=broker, queue_name="q")
        def a() -> None:
            pass

        for key in ("done", "twice", "waiting"):
            a.send_with_options(idempotency_key=key)
        broker.close()
        with psycopg.connect(database_url) as conn:
            assert conn.execute("SELECT count(*) FROM keys_jobs.messages").fetchone() == (3,)
        # And the downgrade drops the table and records revision 13
        downgrade(database_url, schema="keys_jobs", revision="0013")
        assert "idempotency_keys" not in tables(database_url, "keys_jobs")
        with psycopg.connect(database_url) as conn:
            comment = conn.execute(
                "SELECT obj_description('keys_jobs.messages'::regclass, 'pg_class')"
            ).fetchone()
        assert comment == ("dramatiq-pg-outbox schema revision 13",)
    finally:
        drop_schema(database_url, "keys_jobs")


def test_the_upgrade_to_0017_creates_the_audit_table_and_the_downgrade_drops_it(database_url: str) -> None:
    schema = "audit_0017"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        try:
            upgrade(database_url, schema=schema, revision="0017")
            assert conn.execute(f"SELECT to_regclass('{schema}.audit') IS NOT NULL").fetchone() == (True,)
            # A source other than the dashboard and the command line is refused
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(
                    f"INSERT INTO {schema}.audit (operator, source, action, target) "
                    "VALUES ('x', 'y', 'z', 'w')"
                )
            downgrade(database_url, schema=schema, revision="0016")
            assert conn.execute(f"SELECT to_regclass('{schema}.audit') IS NULL").fetchone() == (True,)
        finally:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_the_upgrade_to_0018_counts_history_by_actor_and_outcome_and_the_downgrade_drops_it(
    database_url: str,
) -> None:
    # Given a schema at revision 0017 whose history holds completed, retried, failed and canceled rows
    schema = "finished_0018"
    drop_schema(database_url, schema)
    upgrade(database_url, schema=schema, revision="0017")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {schema}.history (id, queue_name, actor_name, message_id, state, attempts,"
            " enqueued_at, payload, error_type) VALUES"
            " (1, 'q', 'a', 'm1', 'completed', 1, now(), '', NULL),"
            " (2, 'q', 'a', 'm2', 'completed', 1, now(), '', NULL),"
            " (3, 'q', 'a', 'm3', 'completed', 1, now(), '', 'ValueError'),"
            " (4, 'q', 'a', 'm4', 'failed', 2, now(), '', 'ValueError'),"
            " (5, 'q', 'b', 'm5', 'failed', 1, now(), '', 'MaxDeliveriesExceeded'),"
            " (6, 'q', 'b', 'm6', 'failed', 0, now(), '', 'Canceled'),"
            " (7, 'q.DQ', 'b', 'm7', 'completed', 1, now(), '', NULL)"
        )
    try:
        # When it is upgraded to 0018
        upgrade(database_url, schema=schema, revision="0018")
        # Then finished_counts holds history's count per queue, actor and outcome; a cancel is not counted
        with psycopg.connect(database_url) as conn:
            rows = conn.execute(
                f"SELECT queue_name, actor_name, state, shard, n FROM {schema}.finished_counts"
                " ORDER BY 1, 2, 3"
            ).fetchall()
        assert rows == [
            ("q", "a", "completed", 0, 2),
            ("q", "a", "failed", 0, 1),
            ("q", "a", "retried", 0, 1),
            ("q", "b", "failed", 0, 1),
            ("q.DQ", "b", "completed", 0, 1),
        ]
        # And an outcome other than the three is refused (0022 adds canceled)
        with psycopg.connect(database_url) as conn, pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                f"INSERT INTO {schema}.finished_counts (queue_name, actor_name, state, shard, n)"
                " VALUES ('q', 'a', 'canceled', 0, 1)"
            )
        # And the downgrade drops the table and records revision 17
        downgrade(database_url, schema=schema, revision="0017")
        assert "finished_counts" not in tables(database_url, schema)
        with psycopg.connect(database_url) as conn:
            comment = conn.execute(
                f"SELECT obj_description('{schema}.messages'::regclass, 'pg_class')"
            ).fetchone()
        assert comment == ("dramatiq-pg-outbox schema revision 17",)
    finally:
        drop_schema(database_url, schema)


def test_the_upgrade_to_0022_makes_canceled_a_state_of_its_own_and_the_downgrade_restores_dead_letters(
    database_url: str,
) -> None:
    # Given a schema at revision 0020 whose history holds a canceled waiting message (a Canceled
    # dead letter, as cancels were stored then) beside a real dead letter
    schema = "canceled_0022"
    drop_schema(database_url, schema)
    upgrade(database_url, schema=schema, revision="0020")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {schema}.history (id, queue_name, actor_name, message_id, state, attempts,"
            " enqueued_at, payload, error_type) VALUES"
            " (1, 'q', 'a', 'm1', 'failed', 0, now(), '', 'Canceled'),"
            " (2, 'q', 'a', 'm2', 'failed', 3, now(), '', 'ValueError')"
        )
    try:
        # When it is upgraded to 0022
        upgrade(database_url, schema=schema, revision="0022")
        # Then the cancel is in state canceled (counted as such), the dead letter stays failed
        with psycopg.connect(database_url, autocommit=True) as conn:
            assert conn.execute(f"SELECT id, state FROM {schema}.history ORDER BY id").fetchall() == [
                (1, "canceled"),
                (2, "failed"),
            ]
            assert conn.execute(
                f"SELECT state, n FROM {schema}.finished_counts WHERE state = 'canceled'"
            ).fetchall() == [("canceled", 1)]
            # And a processing row can carry a cancel request; history refuses other states
            conn.execute(f"SELECT cancel_requested_at, cancel_reason FROM {schema}.messages")
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(
                    f"INSERT INTO {schema}.history (id, queue_name, actor_name, message_id, state, attempts,"
                    " enqueued_at, payload) VALUES (3, 'q', 'a', 'm3', 'aborted', 0, now(), '')"
                )
        # And the downgrade makes it a Canceled dead letter again and refuses the state
        downgrade(database_url, schema=schema, revision="0020")
        with psycopg.connect(database_url, autocommit=True) as conn:
            assert conn.execute(f"SELECT id, state FROM {schema}.history ORDER BY id").fetchall() == [
                (1, "failed"),
                (2, "failed"),
            ]
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(
                    f"INSERT INTO {schema}.history (id, queue_name, actor_name, message_id, state, attempts,"
                    " enqueued_at, payload) VALUES (3, 'q', 'a', 'm3', 'canceled', 0, now(), '')"
                )
            assert "cancel_reason" not in {
                name
                for (name,) in conn.execute(
                    "SELECT column_name FROM information_schema.columns"
                    " WHERE table_schema = %s AND table_name = 'messages'",
                    (schema,),
                )
            }
    finally:
        drop_schema(database_url, schema)


def test_the_upgrade_to_0023_keeps_limits_for_every_queue_and_the_downgrade_drops_a_queues_own(
    database_url: str,
) -> None:
    # Given a schema at revision 0022 with a run-time limit
    schema = "queue_limits_0023"
    drop_schema(database_url, schema)
    upgrade(database_url, schema=schema, revision="0022")
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {schema}.concurrency_limits (prefix, max_running) VALUES ('c:', 2)")
        # When it is upgraded to 0023
        upgrade(database_url, schema=schema, revision="0023")
        with psycopg.connect(database_url, autocommit=True) as conn:
            # Then the limit applies to every queue, and a queue may have its own of the same prefix
            insert = f"INSERT INTO {schema}.concurrency_limits (queue_name, prefix, max_running) VALUES"
            conn.execute(insert + " ('q', 'c:', 1)")
            rows = f"SELECT queue_name, prefix, max_running FROM {schema}.concurrency_limits ORDER BY 1"
            assert conn.execute(rows).fetchall() == [("", "c:", 2), ("q", "c:", 1)]
            with pytest.raises(psycopg.errors.UniqueViolation):
                conn.execute(insert + " ('q', 'c:', 3)")
        # And the downgrade keeps the limit of every queue and drops the queue's own
        downgrade(database_url, schema=schema, revision="0022")
        with psycopg.connect(database_url, autocommit=True) as conn:
            assert conn.execute(
                f"SELECT prefix, max_running FROM {schema}.concurrency_limits"
            ).fetchall() == [("c:", 2)]
    finally:
        drop_schema(database_url, schema)


def test_the_upgrade_to_0024_plans_the_ring_slot_once_per_session_and_the_downgrade_restores_it(
    database_url: str,
) -> None:
    # Given a schema at revision 0023, whose message_slot() is a SQL function (re-planned in
    # every statement that calls it: PostgreSQL cannot inline a SECURITY DEFINER function)
    schema = "ring_slot_0024"
    drop_schema(database_url, schema)
    upgrade(database_url, schema=schema, revision="0023")
    function = (
        "SELECT l.lanname, p.prosecdef, p.provolatile, p.proconfig FROM pg_proc AS p "
        f"JOIN pg_language AS l ON l.oid = p.prolang WHERE p.oid = '{schema}.message_slot'::regproc"
    )
    ring = f"SELECT {schema}.message_slot(), (SELECT slot FROM {schema}.message_ring)"
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            before = conn.execute(function).fetchone()
            assert before is not None and before[0] == "sql"
        # When it is upgraded to 0024
        upgrade(database_url, schema=schema, revision="0024")
        with psycopg.connect(database_url, autocommit=True) as conn:
            # Then the function is PL/pgSQL (its statement's plan kept for the session), with the
            # same rights, volatility and search_path, and reads the ring's slot, after a turn too
            assert conn.execute(function).fetchone() == ("plpgsql", *before[1:])
            conn.execute(f"UPDATE {schema}.message_ring SET slot = 1")
            assert conn.execute(ring).fetchone() == (1, 1)
            conn.execute(f"UPDATE {schema}.message_ring SET slot = 0")
            assert conn.execute(ring).fetchone() == (0, 0)
        # And the downgrade restores the SQL function
        downgrade(database_url, schema=schema, revision="0023")
        with psycopg.connect(database_url, autocommit=True) as conn:
            assert conn.execute(function).fetchone() == before
            assert conn.execute(ring).fetchone() == (0, 0)
    finally:
        drop_schema(database_url, schema)
