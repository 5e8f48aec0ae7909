"""dramatiq_pg_outbox.django.outbox(): a message exists if and only if its Django transaction commits.

Real PostgreSQL, Django's own connections (psycopg 3), django_dramatiq's broker from the
settings.  Each test commits for real (``transaction=True``): Django's test transaction would
hide what a commit does.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from typing import Any

import dramatiq
import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_dramatiq.models import Task
from dramatiq.brokers.stub import StubBroker
from psycopg import sql as pg_sql

from dramatiq_pg_outbox import OutboxError, PostgresBroker, SchemaNotReady
from dramatiq_pg_outbox.django import outbox
from shop.models import LedgerEntry, Order, Refund
from shop.tasks import send_receipt

from .helpers import url_of, wait_for

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "ledger"])


class Refused(Exception):
    """Raised to roll back an atomic() block."""


@dramatiq.actor(queue_name="rolled_back")
def rolled_back() -> None: ...


@dramatiq.actor(queue_name="committed")
def committed() -> None: ...


def stored(sql: Any, alias: str = "default") -> list[tuple[str, list[Any]]]:
    """(actor, args) of every message in the database's queues, in the order they were written."""
    rows = sql(alias, "SELECT actor_name, payload FROM dramatiq.messages ORDER BY id")
    return [(actor, list(dramatiq.Message.decode(bytes(payload)).args)) for actor, payload in rows]


def stored_ids(sql: Any) -> set[str]:
    return {row[0] for row in sql("default", "SELECT message_id FROM dramatiq.messages")}


def place(total_cents: int = 100) -> Order:
    return Order.objects.create(email="ada@example.com", total_cents=total_cents)


def test_a_message_sent_inside_atomic_is_stored_with_the_order_at_commit(sql: Any) -> None:
    # Given an order placed and its receipt sent inside atomic() and outbox()
    with transaction.atomic(), outbox():
        order = place()
        message = send_receipt.send(order.id)
        # Then, before the commit, another connection sees neither
        assert stored(sql) == []
        assert sql("default", "SELECT count(*) FROM shop_order") == [(0,)]
    # And after it, both
    assert stored(sql) == [("send_receipt", [order.id])]
    assert sql("default", "SELECT id FROM shop_order") == [(order.id,)]
    # And django_dramatiq's AdminMiddleware recorded it after the commit (its after_enqueue hook)
    assert [str(task.id) for task in Task.tasks.all()] == [message.message_id]


def test_a_rollback_takes_the_message_with_the_order(sql: Any) -> None:
    # Given a transaction that sends, then fails
    with pytest.raises(Refused), transaction.atomic(), outbox():
        send_receipt.send(place().id)
        raise Refused
    # Then neither the order nor the message exists, and no after_enqueue hook ran
    assert stored(sql) == []
    assert Order.objects.count() == 0
    assert Task.tasks.count() == 0


def test_a_message_sent_in_a_rolled_back_nested_atomic_vanishes_and_the_others_stay(sql: Any) -> None:
    # Given a transaction with a message before, inside and after a nested atomic() that rolls back,
    # and one inside a savepoint released within the rolled-back one
    with transaction.atomic(), outbox():
        first = place(1)
        send_receipt.send(first.id)
        with contextlib.suppress(Refused), transaction.atomic():
            send_receipt.send(place(2).id)
            with transaction.atomic():
                send_receipt.send(-1)
            raise Refused
        with transaction.atomic():
            kept = place(3)
            send_receipt.send(kept.id)
    # Then exactly the messages outside the rolled-back savepoint are stored, with their orders
    assert stored(sql) == [("send_receipt", [first.id]), ("send_receipt", [kept.id])]
    assert sorted(Order.objects.values_list("total_cents", flat=True)) == [1, 3]
    # And after_enqueue ran for those only
    assert {str(task.id) for task in Task.tasks.all()} == stored_ids(sql)


def test_a_database_error_rolled_back_to_its_savepoint_keeps_the_messages_around_it(sql: Any) -> None:
    # Given a refund, then a transaction that sends, hits a duplicate refund in a nested atomic()
    # (as get_or_create() does), recovers, and sends again
    order = place()
    Refund.objects.create(order=order, reference="r-1")
    with transaction.atomic(), outbox():
        send_receipt.send(1)
        with contextlib.suppress(IntegrityError), transaction.atomic():
            send_receipt.send(2)
            Refund.objects.create(order=order, reference="r-1")
        send_receipt.send(3)
    # Then the messages before and after the failed savepoint are stored, not the one inside it
    assert stored(sql) == [("send_receipt", [1]), ("send_receipt", [3])]
    assert {str(task.id) for task in Task.tasks.all()} == stored_ids(sql)


def test_a_commit_that_fails_on_a_deferred_constraint_stores_nothing(sql: Any) -> None:
    # Given a transaction that sends, then breaks a foreign key that PostgreSQL checks at COMMIT
    with pytest.raises(IntegrityError), transaction.atomic(), outbox():
        send_receipt.send(place().id)
        Refund.objects.create(order_id=2**40, reference="no-such-order")
    # Then the COMMIT failed: no order, no message, and no after_enqueue hook ran
    assert stored(sql) == []
    assert Order.objects.count() == 0
    assert Task.tasks.count() == 0


def test_set_rollback_discards_the_messages_of_the_whole_transaction(sql: Any) -> None:
    # Given a transaction marked for rollback by Django's own API
    with transaction.atomic(), outbox():
        send_receipt.send(place().id)
        transaction.set_rollback(True)
    # Then nothing of it is stored
    assert stored(sql) == []
    assert Order.objects.count() == 0


def test_outside_atomic_a_message_commits_at_once_like_any_statement_in_autocommit(sql: Any) -> None:
    # Given a send in outbox() with no atomic() block (Django's autocommit mode)
    with outbox():
        order = place()
        send_receipt.send(order.id)
        # Then it is stored at once, as the order is
        assert stored(sql) == [("send_receipt", [order.id])]
    assert Task.tasks.count() == 1


def test_enqueue_many_inside_outbox_writes_one_statement(sql: Any, global_broker: Any) -> None:
    # Given a transaction that already sent once (the schema check is done)
    with transaction.atomic(), outbox():
        send_receipt.send(0)
        # When a hundred messages are enqueued together
        with CaptureQueriesContext(connection) as queries:
            global_broker.enqueue_many([send_receipt.message(n) for n in range(1, 101)])
    # Then they were one INSERT on Django's connection, and all are stored
    assert len(queries.captured_queries) == 1
    assert "INSERT INTO" in queries.captured_queries[0]["sql"]
    assert [args for _, args in stored(sql)] == [[n] for n in range(101)]


def test_an_idempotency_key_stores_one_message_and_announces_only_it(sql: Any, global_broker: Any) -> None:
    # Given a keyed receipt sent twice in one transaction, once with an unkeyed message in one
    # statement, and again in a later transaction
    with transaction.atomic(), outbox():
        first = send_receipt.send_with_options(args=(1,), idempotency_key="receipt-1")
        send_receipt.send_with_options(args=(1,), idempotency_key="receipt-1")
        again = send_receipt.message_with_options(args=(1,), idempotency_key="receipt-1")
        global_broker.enqueue_many([again, send_receipt.message(2)])
    with transaction.atomic(), outbox():
        send_receipt.send_with_options(args=(1,), idempotency_key="receipt-1")
    # Then the key stored one message, and after_enqueue ran for the stored ones only
    assert stored(sql) == [("send_receipt", [1]), ("send_receipt", [2])]
    assert {str(task.id) for task in Task.tasks.all()} == stored_ids(sql)
    assert first.message_id in stored_ids(sql)


def test_using_writes_to_that_database_in_its_own_transaction(
    sql: Any, ledger_broker: PostgresBroker
) -> None:
    @dramatiq.actor(broker=ledger_broker)
    def book_entry(entry_id: int) -> None:
        LedgerEntry.objects.using("ledger").filter(pk=entry_id).update(booked_at=timezone.now())

    # Given an order committed on "default" while a ledger transaction inside it rolls back
    with transaction.atomic(), outbox():
        order = place()
        send_receipt.send(order.id)
        with contextlib.suppress(Refused):
            with transaction.atomic(using="ledger"), outbox(using="ledger", broker=ledger_broker):
                book_entry.send(
                    LedgerEntry.objects.using("ledger").create(order_id=order.id, amount_cents=1).id
                )
                raise Refused
    # And a ledger transaction that commits on its own
    with transaction.atomic(using="ledger"), outbox(using="ledger", broker=ledger_broker):
        entry = LedgerEntry.objects.using("ledger").create(order_id=order.id, amount_cents=100)
        book_entry.send(entry.id)
    # Then each database holds the messages of its own committed transactions
    assert stored(sql, "default") == [("send_receipt", [order.id])]
    assert stored(sql, "ledger") == [("book_entry", [entry.id])]
    # And a worker of the ledger's broker runs its message
    worker = dramatiq.Worker(ledger_broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        wait_for(
            lambda: LedgerEntry.objects.using("ledger").get(pk=entry.id).booked_at is not None,
            30,
            "the ledger's worker to book the entry",
        )
    finally:
        worker.stop()


@pytest.mark.parametrize("notify", ["transaction", "after_commit"])
def test_the_wake_up_comes_at_commit_and_never_for_a_rolled_back_message(
    notify: str, global_broker: Any, make_broker: Any
) -> None:
    broker = global_broker if notify == "transaction" else make_broker(notify="after_commit")
    assert broker.notify == notify
    if broker is not global_broker:
        for actor in (rolled_back, committed):
            dramatiq.actor(actor.fn, broker=broker, actor_name=actor.actor_name, queue_name=actor.queue_name)
    with psycopg.connect(url_of("default"), autocommit=True) as listener:
        listener.execute(pg_sql.SQL("LISTEN {}").format(pg_sql.Identifier(broker.channel)))
        # Given a transaction that rolls back, then one whose nested atomic() rolls back
        with contextlib.suppress(Refused), transaction.atomic(), outbox(broker=broker):
            broker.enqueue(rolled_back.message())
            raise Refused
        with transaction.atomic(), outbox(broker=broker):
            with contextlib.suppress(Refused), transaction.atomic():
                broker.enqueue(rolled_back.message())
                raise Refused
            # When the committed one sends to another queue
            broker.enqueue(committed.message())
        # Then the first wake-up to arrive is that queue's (notifications arrive in commit order)
        received = [n.payload for n in listener.notifies(timeout=10, stop_after=1)]
    assert received == ["committed"]


def test_a_stub_broker_ignores_the_binding(sql: Any) -> None:
    # Given an actor of Dramatiq's StubBroker (what django_dramatiq's test settings often use)
    stub = StubBroker()
    ping = dramatiq.actor(lambda: None, broker=stub, actor_name="ping")
    # When it sends inside outbox() in a transaction that rolls back
    with contextlib.suppress(Refused), transaction.atomic(), outbox():
        ping.send()
        raise Refused
    # Then the stub queued it at once, as without outbox(), and no table was written
    assert stub.queues["default"].qsize() == 1
    assert stored(sql) == []


def test_bad_arguments_raise_one_line_naming_the_fix() -> None:
    with pytest.raises(
        OutboxError, match=r"Django has no database 'nope' \(settings.DATABASES has 'default', 'ledger'\)"
    ):
        outbox(using="nope")
    with pytest.raises(OutboxError, match="outbox\\(\\) needs a PostgresBroker"):
        outbox(broker=object())  # type: ignore[arg-type]
    with pytest.raises(OutboxError, match="is synchronous, as Django's atomic\\(\\) is"):
        asyncio.run(enter_async())


async def enter_async() -> None:
    async with outbox():
        pass


def test_missing_tables_raise_schema_not_ready_naming_the_command(make_broker: Any, sql: Any) -> None:
    # Given a broker whose schema was never migrated in Django's database
    broker = make_broker(schema="nowhere")
    actor = dramatiq.actor(lambda: None, broker=broker, actor_name="nowhere_actor")
    # And a password in Django's settings (the connection is open: only the error reads it)
    connection.ensure_connection()
    password = connection.settings_dict["PASSWORD"]
    connection.settings_dict["PASSWORD"] = "hunter2"
    try:
        # When it sends inside outbox()
        with pytest.raises(SchemaNotReady) as raised, transaction.atomic(), outbox(broker=broker):
            actor.send()
    finally:
        connection.settings_dict["PASSWORD"] = password
    # Then the error is one line naming the command that creates them, for that database,
    # with the password masked
    text = str(raised.value)
    assert "\n" not in text
    assert "dramatiq-pg-outbox migrate --url" in text and "--schema nowhere" in text
    assert connection.settings_dict["NAME"] in text
    assert "hunter2" not in text and ":***@" in text


def test_a_send_from_another_thread_is_refused_instead_of_escaping_the_transaction(sql: Any) -> None:
    errors: list[BaseException] = []

    def send() -> None:
        try:
            send_receipt.send(1)
        except OutboxError as error:
            errors.append(error)

    # Given a thread started inside the block with the block's context (its binding)
    with transaction.atomic(), outbox():
        thread = threading.Thread(target=contextvars.copy_context().run, args=(send,))
        thread.start()
        thread.join()
        # And a context copied inside the block, used after it
        later = contextvars.copy_context()
    later.run(send)
    # Then both sends were refused with the reason, and nothing was stored
    assert len(errors) == 2
    assert "another thread" in str(errors[0])
    assert "block has ended" in str(errors[1])
    assert stored(sql) == []


def test_manual_transaction_management_is_refused(sql: Any) -> None:
    # Given Django's connection with autocommit off outside atomic()
    transaction.set_autocommit(False)
    try:
        with outbox(), pytest.raises(OutboxError, match="manual transaction management"):
            send_receipt.send(1)
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert stored(sql) == []
