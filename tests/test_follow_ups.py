"""Follow-ups belong to the ack: nothing middleware sends or stores is lost when the database blips.

Each test runs a real Dramatiq worker on a broker whose every connection goes
through a TCP proxy to the test's PostgreSQL.  The actor cuts the proxy (all
connections closed, new ones refused) as it finishes, and it is restored
2.5 s later: the retry, the next pipeline step, the callback or the result that
Dramatiq's middleware stores right after the actor must still arrive, written
in the same transaction as the ack or nack (docs/guarantees.md, "Follow-ups
belong to the ack").  Before that rule, ``Broker.emit_after`` swallowed the
``ConnectionFailed`` of those writes and the message was acked without them.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.errors import BrokerConnectionError, ConnectionFailed
from dramatiq.results import ResultFailure, Results
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.results import PostgresBackend

from .helpers import Proxy, reachable, wait_for

#: How long the database stays unreachable, in seconds (longer than the pool_timeout below).
OUTAGE = 2.5
#: Broker options of these tests: a connection wait shorter than the outage, so a write
#: during the outage fails as ConnectionFailed instead of waiting for the server.
OPTIONS = {
    "pool_timeout": 1_000,
    "heartbeat_interval": 1_000,
    "heartbeat_timeout": 10_000,
    "rescue_interval": 1_000,
    "max_fetch_interval": 200,
}


class Outage:
    """A proxy in front of the test database, and a way to cut it for ``OUTAGE`` seconds."""

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        self.proxy = Proxy((url.host or "127.0.0.1", url.port or 5432))
        self.url = url.set(host="127.0.0.1", port=self.proxy.port).render_as_string(hide_password=False)
        self.cuts = 0
        #: Who cut, in order (an assertion on ``cuts`` prints it: a delivery run twice shows).
        self.cutters: list[str] = []
        self._timers: list[threading.Timer] = []
        self._sent = threading.Event()
        self._sent.set()

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Hold every cut until the test's own send in this block has returned.

        An actor that cuts as soon as it starts can otherwise cut between the COMMIT of
        the send that enqueued it and the reply reaching the test (the reply crosses this
        process's proxy threads too): the send then raises ``BrokerConnectionError`` for a
        message that was written, and a retried send enqueues it twice. That duplicate is
        the producer's (no client can tell a lost reply from a lost commit), not the
        worker's, which is what these tests are about.
        """
        self._sent.clear()
        try:
            yield
        finally:
            self._sent.set()

    def cut(self, by: str = "") -> None:
        """Close every connection through the proxy now and refuse new ones for ``OUTAGE`` seconds.

        Waits first (at most 30 s) for a send in :meth:`sending` to return.
        """
        self._sent.wait(30)
        self.cuts += 1
        self.cutters.append(by)
        self.proxy.block()
        timer = threading.Timer(OUTAGE, self.proxy.unblock)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.proxy.close()


def send_retrying(send: Callable[[], Any], timeout: float = 30) -> None:
    """Call ``send`` until it does not raise ``BrokerConnectionError`` (at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            send()
            return
        except BrokerConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def outage(database_url: str) -> Iterator[Outage]:
    o = Outage(database_url)
    try:
        yield o
    finally:
        o.close()


@pytest.fixture
def proxied(make_broker: Any, outage: Outage) -> PostgresBroker:
    """A broker (Retries, Callbacks, Pipelines: Dramatiq's defaults) connected through the proxy."""
    return make_broker(url=outage.url, **OPTIONS)  # type: ignore[no-any-return]


def _queue() -> str:
    return f"followups_{uuid.uuid4().hex[:8]}"


def _history(db: Any, queue: str) -> list[tuple[str, str | None]]:
    rows = db.execute(
        "SELECT state, error_type FROM dramatiq.history WHERE queue_name = %s ORDER BY finished_at, id",
        (queue,),
    ).fetchall()
    return [(str(state), error_type) for state, error_type in rows]


def _finished(db: Any, queue: str, n: int) -> Callable[[], bool]:
    return lambda: len(_history(db, queue)) >= n and _pending(db, queue) == 0


def _pending(db: Any, queue: str) -> int:
    row = db.execute("SELECT count(*) FROM dramatiq.messages WHERE queue_name = %s", (queue,)).fetchone()
    return int(row[0])


def test_a_retry_stored_while_the_database_is_unreachable_still_runs(
    db: Any, proxied: PostgresBroker, outage: Outage, start_worker: Any
) -> None:
    # Given an actor that fails once, cutting the database off as it raises
    queue, runs = _queue(), []

    def flaky(key: str) -> None:
        runs.append(key)
        if len(runs) == 1:
            outage.cut(key)
            raise RuntimeError("fails once")

    actor = dramatiq.actor(
        flaky, broker=proxied, queue_name=queue, max_retries=3, min_backoff=50, max_backoff=100
    )
    actor.send("a")
    # When a worker runs it (Retries stores the retry while the database is unreachable)
    start_worker(proxied)
    # Then the retry is written with the ack once the database is back, and runs
    wait_for(lambda: len(runs) == 2, 30, "the retry ran")
    wait_for(_finished(db, queue, 2), 15, "both deliveries archived")
    assert outage.cuts == 1, outage.cutters
    assert _history(db, queue) == [("completed", "RuntimeError"), ("completed", None)]


def test_the_next_pipeline_step_and_callbacks_survive_an_outage(
    db: Any, proxied: PostgresBroker, outage: Outage, start_worker: Any
) -> None:
    queue, seen = _queue(), []

    def step_one(x: int) -> int:
        outage.cut(f"step_one({x})")
        return x + 1

    def step_two(x: int) -> None:
        seen.append(("step_two", x))

    def succeeded(message: dict[str, Any], result: Any) -> None:
        seen.append(("on_success", result))

    def failed(message: dict[str, Any], error: dict[str, str]) -> None:
        seen.append(("on_failure", error["type"]))

    def exhausted(message: dict[str, Any], retries: dict[str, int]) -> None:
        seen.append(("on_retry_exhausted", retries["retries"]))

    def boom() -> None:
        outage.cut("boom")
        raise ValueError("boom")

    one = dramatiq.actor(step_one, broker=proxied, queue_name=queue)
    two = dramatiq.actor(step_two, broker=proxied, queue_name=queue)
    on_success = dramatiq.actor(succeeded, broker=proxied, queue_name=queue)
    on_failure = dramatiq.actor(failed, broker=proxied, queue_name=queue)
    on_exhausted = dramatiq.actor(exhausted, broker=proxied, queue_name=queue)
    fails = dramatiq.actor(boom, broker=proxied, queue_name=queue, max_retries=0)
    start_worker(proxied, worker_threads=1)

    # A pipeline: step_one cuts the database as it returns; Pipelines enqueues step_two then
    with outage.sending():
        (one.message(1) | two.message()).run()
    wait_for(lambda: ("step_two", 2) in seen, 30, "the next pipeline step ran")
    # on_success: Callbacks sends it right after the actor (this test's own sends may meet a pooled
    # connection that the cut closed: a send raises BrokerConnectionError then, and is retried as a
    # producer would; what is tested here is the worker's side)
    with outage.sending():
        send_retrying(lambda: one.send_with_options(args=(10,), on_success=on_success))
    wait_for(lambda: ("on_success", 11) in seen, 30, "on_success ran")
    # on_failure and on_retry_exhausted: sent before a nack
    with outage.sending():
        send_retrying(
            lambda: fails.send_with_options(on_failure=on_failure, on_retry_exhausted=on_exhausted.actor_name)
        )
    wait_for(lambda: ("on_failure", "ValueError") in seen, 30, "on_failure ran")
    wait_for(lambda: ("on_retry_exhausted", 0) in seen, 30, "on_retry_exhausted ran")
    wait_for(_finished(db, queue, 7), 15, "every message archived")
    assert outage.cuts == 3, outage.cutters
    states = sorted(_history(db, queue), key=str)
    assert states == sorted([("completed", None)] * 6 + [("failed", "ValueError")], key=str)


def test_results_stored_while_the_database_is_unreachable_are_kept(
    db: Any, database_url: str, proxied: PostgresBroker, outage: Outage, start_worker: Any
) -> None:
    # Given the PostgreSQL results backend on the broker's database (the test reads
    # the results through a backend of its own that does not go through the proxy)
    proxied.add_middleware(Results(backend=PostgresBackend(broker=proxied)))
    backend = PostgresBackend(url=database_url)
    queue = _queue()

    def answer() -> int:
        outage.cut("answer")
        return 42

    def fail() -> None:
        outage.cut("fail")
        raise KeyError("missing")

    ok = dramatiq.actor(answer, broker=proxied, queue_name=queue, store_results=True)
    bad = dramatiq.actor(fail, broker=proxied, queue_name=queue, store_results=True, max_retries=0)
    start_worker(proxied, worker_threads=1)
    try:
        # When the result is stored (after the actor) and the failure (after the nack) during outages
        with outage.sending():
            message = ok.send()
        assert message.get_result(backend=backend, block=True, timeout=30_000) == 42
        with outage.sending():
            failure = bad.send()
        # Then both are there once the database is back
        with pytest.raises(ResultFailure, match="missing"):
            failure.get_result(backend=backend, block=True, timeout=30_000)
    finally:
        backend.close()
    wait_for(_finished(db, queue, 2), 15, "both archived")
    assert outage.cuts == 2, outage.cutters


def test_a_group_completion_callback_survives_an_outage(
    db: Any, proxied: PostgresBroker, outage: Outage, start_worker: Any
) -> None:
    if not reachable("127.0.0.1", 6379):
        pytest.skip("no Redis server at 127.0.0.1:6379 (GroupCallbacks needs a rate-limiter backend)")
    import redis
    from dramatiq.middleware import GroupCallbacks
    from dramatiq.rate_limits.backends import RedisBackend

    client = redis.Redis(host="127.0.0.1", port=6379)
    # The barrier's key expires a minute after the test.
    proxied.add_middleware(GroupCallbacks(RedisBackend(client=client), barrier_ttl=60_000))
    queue, seen = _queue(), []

    def member(n: int) -> None:
        outage.cut(f"member({n})")
        seen.append(n)

    def completed() -> None:
        seen.append("done")

    work = dramatiq.actor(member, broker=proxied, queue_name=queue)
    done = dramatiq.actor(completed, broker=proxied, queue_name=queue)
    start_worker(proxied, worker_threads=1)
    try:
        g = dramatiq.group([work.message(1)], broker=proxied)
        g.add_completion_callback(done.message())
        with outage.sending():
            g.run()
        wait_for(lambda: "done" in seen, 30, "the group completion callback ran")
    finally:
        client.close()
    wait_for(_finished(db, queue, 2), 15, "both archived")


def test_a_worker_back_from_an_outage_judges_no_other_worker_dead_for_a_heartbeat_timeout(
    db: Any, make_broker: Any, outage: Outage
) -> None:
    from dramatiq_pg_outbox._runtime import Maintenance

    # Given a message running on another worker process, whose heartbeat is stale because
    # the database was out of reach for everybody (here: 30 s old)
    broker = make_broker(url=outage.url, heartbeat_interval=200, heartbeat_timeout=2_000, pool_timeout=1_000)
    other = uuid.uuid4()
    db.execute(
        "INSERT INTO dramatiq.workers (id, hostname, pid, queues, heartbeat_at) "
        "VALUES (%s, 'elsewhere', 1, ARRAY['q'], now() - interval '30 seconds')",
        (other,),
    )
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload, state, attempts, "
        "lease, owner, acquired_at) VALUES ('q', 'a', 'm', '\\x00', 'processing', 1, %s, %s, now())",
        (uuid.uuid4(), other),
    )
    maintenance = Maintenance(broker.runtime)
    # When this worker's own maintenance pass fails during the outage, then succeeds
    outage.proxy.block()
    with pytest.raises(ConnectionFailed):
        maintenance.run_once()
    outage.proxy.unblock()
    wait_for(lambda: _ticks(maintenance), 10, "a maintenance pass after the outage")
    # Then it heartbeats but releases nothing yet: the others get heartbeat_timeout to heartbeat again
    assert _state_of(db) == "processing"

    # And once that has passed (passes every 0.1 s, as its loop would), a worker that is still
    # silent counts as dead
    def released() -> bool:
        maintenance.run_once()
        return _state_of(db) == "pending"

    waited = wait_for(released, 10, "the silent worker's message released")
    assert waited >= 1.5


def _ticks(maintenance: Any) -> bool:
    try:
        maintenance.run_once()
        return True
    except ConnectionFailed:
        return False


def _state_of(db: Any) -> str:
    return str(db.execute("SELECT state FROM dramatiq.messages WHERE message_id = 'm'").fetchone()[0])
