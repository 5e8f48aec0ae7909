"""Idempotency keys: at most one message per key, in the hot table and after it was processed."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from typing import Any

import dramatiq
import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox
from dramatiq_pg_outbox._queries import queries_for_schema
from dramatiq_pg_outbox._runtime import StoredMessage, enqueue_result, enqueue_statement, fence_params
from dramatiq_pg_outbox.cli.main import main
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.partitions import prune
from dramatiq_pg_outbox.store.messages import MessageStore

from .helpers import ISOLATION_LEVELS, wait_for

QUERIES = queries_for_schema("dramatiq")


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


def connect_at(url: str, isolation: str) -> psycopg.Connection[Any]:
    """A connection whose transactions default to ``isolation`` (a URL's ``options=-c ...``)."""
    return psycopg.connect(url, options="-c default_transaction_isolation=" + isolation.replace(" ", "\\ "))


def stored_count(db: Any, key: str) -> int:
    """Rows of ``key`` in messages and history together: 1 is the promise."""
    row = db.execute(
        "SELECT (SELECT count(*) FROM dramatiq.messages WHERE idempotency_key = %(k)s)"
        " + (SELECT count(*) FROM dramatiq.history WHERE idempotency_key = %(k)s)",
        {"k": key},
    ).fetchone()
    return int(row[0])


def claim(db: Any, key: str) -> tuple[int, uuid.UUID]:
    """Claim the message of ``key`` as a consumer does (state, attempt, lease): (row id, lease)."""
    row = db.execute(
        "UPDATE dramatiq.messages SET state = 'processing', attempts = attempts + 1,"
        " lease = gen_random_uuid(), acquired_at = now() WHERE idempotency_key = %s RETURNING id, lease",
        (key,),
    ).fetchone()
    assert row is not None
    return int(row[0]), row[1]


def keyed_send(conn: psycopg.Connection[Any], broker: PostgresBroker, actor: Any, key: str) -> list[str]:
    """The package's enqueue statement for one keyed message, in ``conn``'s transaction, committed.

    Returns the message ids stored (empty: the key was taken)."""
    item = StoredMessage.of(actor.message_with_options(args=(1,), idempotency_key=key))
    statement = enqueue_statement([item], broker.channel, True, 0)
    rows = MessageStore("dramatiq").enqueue(conn.cursor(), statement)
    conn.commit()
    return [stored.message.message_id for stored in enqueue_result(statement.name, [item], rows).stored]


def race_the_archive(
    database_url: str,
    broker: PostgresBroker,
    actor: Any,
    key: str,
    isolation: str,
    outcome: str,
    ack_isolation: str = "read committed",
) -> tuple[list[str] | None, BaseException | None]:
    """Send ``key`` again while the archive of its claimed message is in progress, then commit that.

    The archive (the flusher's ack, or its archive of a dead letter) runs in a transaction held
    open on one connection, at ``ack_isolation``; the send runs on another, in a thread, at
    ``isolation``.  The archive commits once the send has finished or waits for a lock.
    Returns (message ids the send stored, or None; the error it raised, or None).
    """
    ack = connect_at(database_url, ack_isolation)
    sender = connect_at(database_url, isolation)
    try:
        with psycopg.connect(database_url, autocommit=True) as db:
            row_id, lease = claim(db, key)
        params = fence_params([(row_id, lease)])
        if outcome == "ack":
            archived = ack.execute(QUERIES["ack"], params).fetchall()
        else:
            params.update(state="failed", error_types=["RuntimeError"], errors=["boom"])
            archived = ack.execute(QUERIES["archive"], params).fetchall()
        assert archived == [(row_id, lease)]
        pid = sender.info.backend_pid
        result: list[list[str]] = []
        errors: list[BaseException] = []

        def send() -> None:
            try:
                result.append(keyed_send(sender, broker, actor, key))
            except psycopg.errors.SerializationFailure as exc:
                errors.append(exc)
                sender.rollback()

        thread = threading.Thread(target=send)
        thread.start()
        with psycopg.connect(database_url, autocommit=True) as db:
            waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
            wait_for(lambda: not thread.is_alive() or bool(db.execute(waiting, (pid,)).fetchone()[0]), 10,
                     "the send to end or to wait for the archive's lock")  # fmt: skip
        ack.commit()
        thread.join(10)
        assert not thread.is_alive()
        return (result[0] if result else None), (errors[0] if errors else None)
    finally:
        ack.close()
        sender.close()


@pytest.mark.parametrize("outcome", ["ack", "archive"])
@pytest.mark.parametrize(
    ("isolation", "ack_isolation"),
    [(level, "read committed") for level in ISOLATION_LEVELS]
    + [("repeatable read", "repeatable read"), ("serializable", "serializable")],
)
def test_a_send_racing_the_archive_of_its_key_is_refused(
    database_url: str,
    db: Any,
    broker: PostgresBroker,
    actor: Any,
    isolation: str,
    ack_isolation: str,
    outcome: str,
) -> None:
    """Issue 31, defect 1: before the keys table, the send waited on the unique index behind the
    archive, found no conflict once it committed, and missed the key in history (its snapshot
    predates the archive): the key was stored twice, with the send at any isolation level and the
    archive at READ COMMITTED (the flusher's) or REPEATABLE READ.  (Both at SERIALIZABLE, the send
    failed with a serialization error.)"""
    # Given a keyed message, claimed, whose archive is in progress
    first = actor.send_with_options(args=(1,), idempotency_key="racing")
    # When the same key is sent again on another connection, and the archive commits
    stored, error = race_the_archive(database_url, broker, actor, "racing", isolation, outcome, ack_isolation)
    # Then the second send stored nothing (or failed with a serialization error, never both)
    assert stored == [] or (stored is None and isinstance(error, psycopg.errors.SerializationFailure))
    # And the key is stored once: the first message, in history
    assert stored_count(db, "racing") == 1
    assert db.execute("SELECT message_id FROM dramatiq.history").fetchall() == [(first.message_id,)]


def test_each_key_runs_once_while_a_producer_resends_it_during_its_ack(
    worker_process: Any, producer: Any, db: Any
) -> None:
    """Retrying clients re-send each key for about 100 ms while a real worker runs and acks it.

    Before the keys table 90 of 100 keys ran twice in a setting like this one (issue 31)."""
    # Given a real worker process
    worker_process(threads=4)
    keys_sent = [f"resent-{i}" for i in range(40)]
    together = threading.Barrier(4)

    def resend() -> None:
        for key in keys_sent:
            together.wait(30)
            until = time.monotonic() + 0.1
            while time.monotonic() < until:
                producer.record.send_with_options(args=(key,), idempotency_key=key)

    # When four clients re-send each key together, one key after the other, for 100 ms each
    threads = [threading.Thread(target=resend) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    ran = "SELECT count(*) FROM received"
    wait_for(lambda: count_rows(db, ran) == len(keys_sent), 60, "every key to run")
    wait_for(lambda: count_rows(db, "SELECT count(*) FROM dramatiq.messages") == 0, 60, "the queue to drain")
    # Then every key ran exactly once and is stored once
    runs = dict(db.execute("SELECT key, n FROM received").fetchall())
    assert {key: n for key, n in runs.items() if n != 1} == {}
    assert sorted(runs) == sorted(keys_sent)
    archived = "SELECT count(*) FROM dramatiq.history WHERE idempotency_key LIKE 'resent-%%'"
    assert count_rows(db, archived) == len(keys_sent)


def count_rows(db: Any, query: str) -> int:
    return int(db.execute(query).fetchone()[0])


def taken(db: Any) -> list[str]:
    """The keys of idempotency_keys (migration 0014), in order."""
    return [r[0] for r in db.execute("SELECT idempotency_key FROM dramatiq.idempotency_keys ORDER BY 1")]


def test_a_retried_dead_letter_keeps_its_key(
    database_url: str, db: Any, broker: PostgresBroker, actor: Any
) -> None:
    """retry-failed puts a keyed dead letter back with its key: a send of that key is refused while
    the retried message waits, and while its ack is in progress (which on the parent commit stored
    the key a second time), and after it, until prune."""
    # Given a keyed message that became a dead letter
    actor.send_with_options(args=(1,), idempotency_key="retried")
    row_id, lease = claim(db, "retried")
    db.execute(
        QUERIES["archive"],
        {**fence_params([(row_id, lease)]), "state": "failed", "error_types": ["E"], "errors": ["e"]},
    )
    # When an operator retries it
    assert main(["retry-failed", "--url", database_url, "--id", str(row_id)]) == 0
    # Then a send of its key is refused while it waits
    assert keyed_send(db, broker, actor, "retried") == []
    # And while its ack is in progress, and after it
    stored, _ = race_the_archive(database_url, broker, actor, "retried", "read committed", "ack")
    assert stored == []
    assert keyed_send(db, broker, actor, "retried") == []
    assert stored_count(db, "retried") == 1
    assert taken(db) == ["retried"]


def test_a_key_is_refused_until_prune_removes_its_history_row(
    database_url: str, db: Any, broker: PostgresBroker, actor: Any
) -> None:
    """The window of the promise (docs/guarantees.md, "Idempotency keys")."""
    # Given a key whose waiting message was purged
    actor.send_with_options(args=(1,), idempotency_key="purged")
    broker.flush(actor.queue_name)
    # And two keys whose messages were processed, one 10 days ago and one now
    for key in ("old", "new"):
        actor.send_with_options(args=(1,), idempotency_key=key)
        db.execute(QUERIES["ack"], fence_params([claim(db, key)]))
    db.execute(
        "UPDATE dramatiq.history SET finished_at = now() - interval '10 days' WHERE idempotency_key = 'old'"
    )
    # Then each is refused before prune
    for key in ("old", "new", "purged"):
        assert keyed_send(db, broker, actor, key) == [], key
    assert stored_count(db, "purged") == 0
    # When prune removes what finished more than 7 days ago
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert prune(conn, "dramatiq", dt.timedelta(days=7), dry_run=True).freed_keys == 2
        assert prune(conn, "dramatiq", dt.timedelta(days=7)).freed_keys == 2
    # Then the keys of no stored message are free again, the other one still refused
    assert taken(db) == ["new"]
    assert len(keyed_send(db, broker, actor, "old")) == 1
    assert len(keyed_send(db, broker, actor, "purged")) == 1
    assert keyed_send(db, broker, actor, "new") == []
