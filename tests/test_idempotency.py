"""Idempotency keys: at most one message per key, in the hot table and after it was processed."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url


def keys(db: Any, table: str = "messages") -> list[Any]:
    rows = db.execute(f"SELECT idempotency_key FROM dramatiq.{table} ORDER BY id").fetchall()
    return [r[0] for r in rows]


@pytest.fixture
def actor(broker: PostgresBroker) -> Any:
    @dramatiq.actor(broker=broker)
    def notify_customer(customer_id: int) -> None:
        pass

    return notify_customer


def test_a_second_send_with_the_same_key_adds_nothing(db: Any, actor: Any) -> None:
    actor.send_with_options(args=(1,), idempotency_key="batch-1:1")
    actor.send_with_options(args=(1,), idempotency_key="batch-1:1")
    actor.send_with_options(args=(2,), idempotency_key="batch-1:2")
    assert keys(db) == ["batch-1:1", "batch-1:2"]


def test_messages_without_a_key_never_conflict(db: Any, actor: Any) -> None:
    for _ in range(3):
        actor.send(1)
    assert keys(db) == [None, None, None]


def test_a_key_already_processed_is_not_enqueued_again(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    runs: list[int] = []

    @dramatiq.actor(broker=broker)
    def once(customer_id: int) -> None:
        runs.append(customer_id)

    once.send_with_options(args=(7,), idempotency_key="k7")
    start_worker(broker)
    broker.join(once.queue_name, timeout=10_000)
    assert keys(db, "history") == ["k7"]
    # The message left the hot table; the key is still known from history.
    once.send_with_options(args=(7,), idempotency_key="k7")
    assert keys(db) == []
    broker.join(once.queue_name, timeout=10_000)
    assert runs == [7]


def test_retries_of_a_keyed_message_are_not_swallowed(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    calls: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=10, max_backoff=50)
    def flaky(customer_id: int) -> None:
        calls.append(customer_id)
        if len(calls) < 3:
            raise RuntimeError("transient")

    flaky.send_with_options(args=(1,), idempotency_key="flaky-1")
    start_worker(broker)
    broker.join(flaky.queue_name, timeout=20_000)
    assert calls == [1, 1, 1]
    rows = db.execute(
        "SELECT state, error_type, idempotency_key FROM dramatiq.history ORDER BY finished_at, id"
    ).fetchall()
    # The first delivery carries the key; its retries are the same message again.
    assert rows == [("completed", "RuntimeError", "flaky-1"), ("completed", "RuntimeError", None),
                    ("completed", None, None)]  # fmt: skip
    flaky.send_with_options(args=(1,), idempotency_key="flaky-1")
    assert keys(db) == []


def test_duplicate_keys_in_one_outbox_transaction_are_stored_once(
    database_url: str, db: Any, actor: Any
) -> None:
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    try:
        with Session(engine) as session:
            with outbox(session):
                actor.send_with_options(args=(1,), idempotency_key="tx:1")
                actor.send_with_options(args=(1,), idempotency_key="tx:1")
                actor.send_with_options(args=(2,), idempotency_key="tx:2")
                actor.send(3)
            session.commit()
        with Session(engine) as session:
            with outbox(session):
                actor.send_with_options(args=(1,), idempotency_key="tx:1")
            session.commit()
    finally:
        engine.dispose()
    assert keys(db) == ["tx:1", "tx:2", None]


def test_the_first_message_with_a_key_wins(db: Any, actor: Any) -> None:
    first = actor.send_with_options(args=(1,), idempotency_key="same")
    actor.send_with_options(args=(2,), idempotency_key="same")
    rows = db.execute("SELECT message_id FROM dramatiq.messages").fetchall()
    assert rows == [(first.message_id,)]


@pytest.mark.parametrize("bad", ["", 12, ["a"]])
def test_a_key_that_is_not_a_string_is_refused(db: Any, actor: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match="idempotency_key must be a non-empty string"):
        actor.send_with_options(args=(1,), idempotency_key=bad)
    assert keys(db) == []
