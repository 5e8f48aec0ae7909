"""Guards at send(): a message over ``max_message_bytes``, an argument that cannot be encoded.

A message over the limit is refused by ``send()`` with one line that names the actor, the
size and the limit, before anything is written (inside ``outbox()`` too); a follow-up over
it (the next step of a pipeline, a result) quarantines the message whose hooks sent it,
which is never retried.  An argument Dramatiq's JSON encoder cannot encode raises at
``send()`` naming the actor and the argument.
"""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from dramatiq import pipeline
from dramatiq.results import ResultMissing, Results
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import MessageTooLarge, PostgresBroker, outbox
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.options import MAX_MESSAGE_BYTES
from dramatiq_pg_outbox.periodic import Scheduler, periodic
from dramatiq_pg_outbox.results import PostgresBackend

from .helpers import count, wait_for

MESSAGES = "SELECT count(*) FROM dramatiq.messages"


def history(db: Any) -> list[tuple[str, str, str | None, int]]:
    return [
        tuple(row)
        for row in db.execute(
            "SELECT actor_name, state, error_type, attempts FROM dramatiq.history ORDER BY id"
        ).fetchall()
    ]


def test_a_message_over_the_limit_is_refused_by_send_in_one_line_and_nothing_is_stored(
    make_broker: Any, db: Any
) -> None:
    broker = make_broker(max_message_bytes=2_000)

    @dramatiq.actor(broker=broker)
    def upload(blob: str) -> None:
        pass

    with pytest.raises(MessageTooLarge) as raised:
        upload.send("x" * 5_000)
    text_ = str(raised.value)
    assert "\n" not in text_
    assert "'upload'" in text_ and "max_message_bytes=2,000" in text_
    assert (raised.value.actor_name, raised.value.limit) == ("upload", 2_000)
    assert raised.value.size > 5_000
    # A batch with one message over the limit stores none of them
    with pytest.raises(MessageTooLarge):
        broker.enqueue_many([upload.message("small"), upload.message("x" * 5_000)])
    assert count(db, MESSAGES) == 0
    # Under the limit, it is stored
    upload.send("x" * 1_000)
    assert count(db, MESSAGES) == 1


def test_the_default_limit_is_one_mebibyte_and_none_disables_it(make_broker: Any, db: Any) -> None:
    assert MAX_MESSAGE_BYTES == 1_048_576
    limited, unlimited = make_broker(), make_broker(max_message_bytes=None)
    assert limited.max_message_bytes == MAX_MESSAGE_BYTES
    big = "x" * (MAX_MESSAGE_BYTES + 1)
    with pytest.raises(MessageTooLarge, match="1,048,576"):
        limited.enqueue(dramatiq.Message("default", "big", (big,), {}, {}))
    unlimited.enqueue(dramatiq.Message("default", "big", (big,), {}, {}))
    assert count(db, MESSAGES) == 1


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1000"])
def test_a_bad_limit_is_refused_at_construction(make_broker: Any, value: Any) -> None:
    with pytest.raises(ValueError, match="max_message_bytes="):
        make_broker(max_message_bytes=value)


def test_inside_an_outbox_the_send_fails_before_the_commit_and_nothing_is_written(
    make_broker: Any, db: Any, database_url: str
) -> None:
    broker = make_broker(max_message_bytes=2_000)

    @dramatiq.actor(broker=broker)
    def receipt(order: int, pdf: str) -> None:
        pass

    # (a table of its own: the test database is shared, and test_chaos has its own "orders")
    db.execute("DROP TABLE IF EXISTS guarded_orders; CREATE TABLE guarded_orders (id int PRIMARY KEY)")
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    try:
        # When an order and its too-large message are written in one transaction
        with pytest.raises(MessageTooLarge), Session(engine) as session, session.begin():
            with outbox(session):
                session.execute(text("INSERT INTO guarded_orders VALUES (1)"))
                receipt.send(1, "x" * 5_000)
        # Then neither is: send() raised inside the block, so the transaction rolled back
        assert count(db, "SELECT count(*) FROM guarded_orders") == 0
        assert count(db, MESSAGES) == 0
        # And a message under the limit commits with its order
        with Session(engine) as session, session.begin(), outbox(session):
            session.execute(text("INSERT INTO guarded_orders VALUES (2)"))
            receipt.send(2, "x" * 100)
        assert (count(db, "SELECT count(*) FROM guarded_orders"), count(db, MESSAGES)) == (1, 1)
    finally:
        engine.dispose()
        db.execute("DROP TABLE IF EXISTS guarded_orders")


def test_a_pipeline_step_over_the_limit_quarantines_the_step_that_sent_it(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    broker = make_broker(max_message_bytes=4_000)
    ran: list[str] = []

    @dramatiq.actor(broker=broker, max_retries=3)
    def render(n: int) -> str:
        ran.append("render")
        return "x" * n

    @dramatiq.actor(broker=broker)
    def publish(page: str) -> None:
        ran.append("publish")

    # Given a pipeline whose first step returns more than the limit lets the next one carry
    pipeline([render.message(10_000), publish.message()], broker=broker).run()
    pipeline([render.message(10), publish.message()], broker=broker).run()
    start_worker(broker)
    wait_for(lambda: len(history(db)) == 3, 30, "both pipelines to end")
    # Then the first render is quarantined (failed, once, with the reason), never retried, and
    # its next step not enqueued; the other pipeline runs through
    rows = history(db)
    assert ("render", "failed", "FollowUpNotWritable", 1) in rows
    assert sorted(r[:2] for r in rows) == [
        ("publish", "completed"),
        ("render", "completed"),
        ("render", "failed"),
    ]
    assert sorted(ran) == ["publish", "render", "render"]
    (error,) = db.execute("SELECT error FROM dramatiq.history WHERE state = 'failed'").fetchone()
    assert "'publish'" in error and "max_message_bytes=4,000" in error
    assert "The delivery itself completed" in error
    assert count(db, MESSAGES) == 0


def test_a_result_over_the_limit_quarantines_its_message(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    broker = make_broker(max_message_bytes=4_000)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(broker=broker, store_results=True, max_retries=3)
    def report(n: int) -> str:
        return "y" * n

    big, small = report.send(10_000), report.send(10)
    start_worker(broker)
    try:
        assert backend.get_result(small, block=True, timeout=30_000) == "y" * 10
        wait_for(lambda: len(history(db)) == 2, 30, "both messages to end")
        ((error_type, error, attempts),) = db.execute(
            "SELECT error_type, error, attempts FROM dramatiq.history WHERE message_id = %s",
            (big.message_id,),
        ).fetchall()
        assert (error_type, attempts) == ("FollowUpNotWritable", 1)
        assert "the result of actor 'report'" in error and "max_message_bytes=4,000" in error
        with pytest.raises(ResultMissing):
            backend.get_result(big)
    finally:
        # (its LISTEN connection for blocking reads ends with it, not with the broker)
        backend.close()


def test_a_schedule_whose_message_is_over_the_limit_is_refused_when_declared(make_broker: Any) -> None:
    broker = make_broker(max_message_bytes=1_000)

    @periodic(every=60_000, args=("z" * 2_000,))
    @dramatiq.actor(broker=broker)
    def nightly(blob: str) -> None:
        pass

    with pytest.raises(
        ValueError, match=r"schedule 'nightly' is [\d,]+ bytes encoded.*max_message_bytes=1,000"
    ):
        Scheduler(broker)


class Opaque:
    """Not JSON serializable."""


@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        ((1, Opaque(), 3), {}, "argument 1 (a Opaque)"),
        ((1,), {"when": {1, 2}}, "keyword argument 'when' (a set)"),
    ],
)
def test_an_argument_that_cannot_be_encoded_is_named_at_send(
    broker: PostgresBroker, db: Any, args: tuple[Any, ...], kwargs: dict[str, Any], named: str
) -> None:
    @dramatiq.actor(broker=broker)
    def charge(*args: Any, **kwargs: Any) -> None:
        pass

    with pytest.raises(TypeError) as raised:
        charge.send(*args, **kwargs)
    assert str(raised.value).startswith(f"cannot send actor 'charge': {named} cannot be encoded: ")
    assert "not JSON serializable" in str(raised.value)
    assert count(db, MESSAGES) == 0
