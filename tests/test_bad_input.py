"""Bad input gets a clear error before any SQL, and loses nothing."""

from __future__ import annotations

import logging
from typing import Any

import dramatiq
import pytest
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.testing import ThrowawayPostgres


# "abc\n": ``$`` matches before a final newline, so the rule is checked with ``fullmatch``.
@pytest.mark.parametrize("name", ["", "1abc", "has space", "semi;colon", "quote'", "é", "a" * 300, "abc\n"])
def test_invalid_queue_names_are_rejected_before_any_sql(name: str) -> None:
    # An unreachable URL proves no connection is attempted.
    broker = PostgresBroker(url="postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(ValueError, match="Invalid queue name"):
        broker.declare_queue(name)
    with pytest.raises(ValueError, match="Invalid queue name"):
        broker.consume(name)


@pytest.mark.parametrize("schema", ["", "1x", 'x"; DROP TABLE y; --', "a-b", "a.b", "x" * 64, "dramatiq\n"])
def test_invalid_schema_names_are_rejected_before_any_sql(schema: str) -> None:
    with pytest.raises(ValueError, match="Invalid schema name"):
        PostgresBroker(url="postgresql://nobody@127.0.0.1:1/none", schema=schema)
    with pytest.raises(ValueError, match="Invalid schema name"):
        upgrade("postgresql://nobody@127.0.0.1:1/none", schema=schema)


@pytest.mark.parametrize("name", ["fsync\n", "1fsync", "fsync = off\nlisten_addresses"])
def test_a_throwaway_server_refuses_a_bad_setting_name_before_starting(name: str) -> None:
    # A newline would start a second line of postgresql.conf.
    with pytest.raises(ValueError, match="invalid setting name"):
        ThrowawayPostgres({name: "off"})


def test_a_message_with_an_invalid_queue_name_is_not_enqueued(broker: PostgresBroker, db: Any) -> None:
    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    with pytest.raises(ValueError):
        broker.enqueue(task.message().copy(queue_name="bad name"))
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 0


def test_non_postgres_urls_and_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="PostgreSQL"):
        PostgresBroker(url="mysql://root@localhost/db")
    with pytest.raises(ValueError):
        PostgresBroker(url="postgresql://x@127.0.0.1:1/db", notify="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PostgresBroker(url="postgresql://x@127.0.0.1:1/db", max_deliveries=0)


def test_no_password_reaches_a_log_line_or_an_error(
    database_url: str, caplog: pytest.LogCaptureFixture, db: Any
) -> None:
    db.execute("DO $$ BEGIN CREATE ROLE pw_user LOGIN PASSWORD 's3cret-pw' SUPERUSER; "
               "EXCEPTION WHEN duplicate_object THEN NULL; END $$")  # fmt: skip
    url = make_url(database_url).set(username="pw_user", password="s3cret-pw")
    caplog.set_level(logging.DEBUG)
    broker = PostgresBroker(url=url, schema="missing_schema")
    assert "s3cret-pw" not in repr(broker)

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    with pytest.raises(Exception) as excinfo:
        task.send()
    assert "s3cret-pw" not in str(excinfo.value)
    broker.close()
    assert "s3cret-pw" not in caplog.text


def test_an_unreachable_server_surfaces_as_dramatiqs_connection_error() -> None:
    from dramatiq.errors import BrokerConnectionError

    broker = PostgresBroker(url="postgresql://nobody@127.0.0.1:1/none", pool_timeout=500)

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    with pytest.raises(BrokerConnectionError):
        task.send()
    broker.close()
