"""One LISTEN connection per process and database, shared by consumers, result waiters and the relay."""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
from dramatiq import Message
from dramatiq.brokers.stub import StubBroker
from dramatiq.results import Results

from dramatiq_pg_outbox._runtime.listener import subscribe
from dramatiq_pg_outbox.relay import Relay
from dramatiq_pg_outbox.results import PostgresBackend
from tests.helpers import LISTENERS, count, wait_for

#: Generous bound for things that take milliseconds, in seconds (a loaded 2-core machine).
SOON = 15


def test_one_listen_connection_serves_consumers_result_waiters_and_the_relay(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given one process with a consuming worker, a results backend and a relay on one database
    broker = make_broker()
    backend = PostgresBackend(broker=broker, cleanup_interval=None)
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(broker=broker, store_results=True)
    def answer() -> int:
        return 42

    start_worker(broker)
    target = StubBroker()
    target.declare_queue("outbound")
    relay = Relay(broker, target, ["outbound"])
    relaying = threading.Thread(target=relay.run, daemon=True)
    relaying.start()
    try:
        # When a reader blocks on a result that is stored 2 s from now
        message = answer.send_with_options(delay=2_000)
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(backend.get_result(message, block=True)))
        reader.start()
        wait_for(lambda: backend.waiting == 1, SOON, "the reader to wait on its notification")
        # Then the consumers, the reader and the relay share one LISTEN connection
        assert broker.runtime.listener is not None and broker.runtime.listener.connected.is_set()
        assert backend.listening
        assert count(db, LISTENERS) == 1
        assert (
            count(
                db,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name LIKE 'dramatiq-pg-outbox:%%:%%'",
            )
            == 1
        )
        # And each is woken through it: the reader gets its result, the relay its message
        reader.join(SOON)
        assert got == [42]
        broker.enqueue(Message(queue_name="outbound", actor_name="elsewhere", args=(), kwargs={}, options={}))
        wait_for(lambda: target.queues["outbound"].qsize() == 1, SOON, "the relayed message")
    finally:
        relay.stop()
        relaying.join(SOON)
        backend.close()
    # And once every subscriber is gone, the connection is closed
    broker.close()
    wait_for(lambda: count(db, LISTENERS) == 0, SOON, "the LISTEN connection to close")


def test_a_channel_subscribed_to_on_a_busy_listener_hears_a_notification_sent_as_subscribe_returns(
    make_broker: Any, db: Any
) -> None:
    # Given a process whose LISTEN connection already serves a channel
    broker = make_broker()
    first = subscribe(broker.conninfo, "dpo_test_first", lambda payload: None, lambda: None)
    second = None
    try:
        wait_for(first.connected.is_set, SOON, "the first channel to be listened to")
        # When a second channel is subscribed to and a notification is sent on it at once
        heard: list[str] = []
        second = subscribe(broker.conninfo, "dpo_test_second", heard.append, lambda: None)
        db.execute("SELECT pg_notify('dpo_test_second', 'sent')")
        # Then it is heard: the LISTEN was in force when subscribe() returned (it used to run at
        # the listener's next 0.5 s tick, and a notification sent before it was never delivered)
        wait_for(lambda: heard == ["sent"], SOON, "the notification on the new channel")
        assert second.connected.is_set()
    finally:
        if second is not None:
            second.close()
        first.close()
