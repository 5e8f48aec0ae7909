"""PostgresBackend: Dramatiq's results tests, run on a real PostgreSQL with real Workers.

The first part follows Dramatiq's own tests/test_results.py and the results
cases of tests/test_composition.py, one test per case and under the same
name, with ``PostgresBroker`` + ``PostgresBackend`` in place of the stub
broker and the Redis/Memcached/stub backends.  Where Dramatiq's tests wait
with ``time.sleep`` for an actor to be "still running" or "done", these hold
the actor on an event the test releases, so the order of events is certain.
The second part covers what is ours: TTL on the database clock, the cleanup,
the NOTIFY wake-up, polling without LISTEN, the pool, errors, the migration,
and a full ``dramatiq`` CLI stack without Redis.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import Message, group
from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware import Middleware, SkipMessage
from dramatiq.results import ResultFailure, ResultMissing, Results, ResultTimeout

from dramatiq_pg_outbox import PostgresBroker, SchemaNotReady, downgrade, upgrade
from dramatiq_pg_outbox.migrations import SCHEMA_REVISION
from dramatiq_pg_outbox.results import PostgresBackend
from tests.helpers import count, wait_for

ROOT = Path(__file__).resolve().parent.parent

#: Generous bound for things that take milliseconds, in seconds (a loaded 2-core machine).
SOON = 15


@pytest.fixture
def make_backend(make_broker: Any, db: Any) -> Iterator[Any]:
    """Factory of PostgresBackends (cleanup thread off unless asked); empties the results table."""
    db.execute("TRUNCATE dramatiq.results")
    backends: list[PostgresBackend] = []

    def factory(**options: Any) -> PostgresBackend:
        options.setdefault("cleanup_interval", None)
        backend = PostgresBackend(**options)
        backends.append(backend)
        return backend

    yield factory
    for backend in backends:
        backend.close()


@pytest.fixture
def stack(make_broker: Any, make_backend: Any) -> tuple[PostgresBroker, PostgresBackend]:
    """A PostgresBroker (the global broker) with the Results middleware on a PostgresBackend."""
    broker = make_broker()
    backend = make_backend(broker=broker)
    broker.add_middleware(Results(backend=backend))
    return broker, backend


@pytest.fixture
def results_broker(stack: tuple[PostgresBroker, PostgresBackend]) -> PostgresBroker:
    return stack[0]


@pytest.fixture
def result_backend(stack: tuple[PostgresBroker, PostgresBackend]) -> PostgresBackend:
    return stack[1]


@pytest.fixture
def gates(make_broker: Any) -> Iterator[defaultdict[Any, threading.Event]]:
    """Events that hold actors until the test releases them; all set at teardown, before workers stop."""
    events: defaultdict[Any, threading.Event] = defaultdict(threading.Event)
    yield events
    for event in list(events.values()):
        event.set()


def stored_keys(db: Any) -> list[str]:
    return [row[0] for row in db.execute("SELECT message_key FROM dramatiq.results ORDER BY message_key")]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- Dramatiq's tests/test_results.py -----------------------------------------


def test_actors_can_store_results(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, db: Any
) -> None:
    # Given an actor that stores results
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        return 42

    start_worker(results_broker)
    # When I send that actor a message and wait for a result
    message = do_work.send()
    result = result_backend.get_result(message, block=True)
    # Then the result is what the actor returned, read from the results table
    assert result == 42
    assert stored_keys(db) == [result_backend.build_message_key(message)]


def test_actors_results_are_backwards_compatible(
    results_broker: PostgresBroker, result_backend: PostgresBackend
) -> None:
    # Given an actor that stores results
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        return 42

    # And a result stored unwrapped, as older Dramatiq versions did
    message = do_work.message()
    result_backend._store(result_backend.build_message_key(message), 42, 3_600_000)
    # When I get that result, then it is unwrapped correctly
    assert result_backend.get_result(message, block=True) == 42


def test_use_namespace_prefix_keys_produces_readable_key(
    make_broker: Any, make_backend: Any, start_worker: Any, db: Any
) -> None:
    # Given a backend with readable keys in a namespace of its own
    broker = make_broker()
    backend = make_backend(broker=broker, namespace="myns", use_namespace_prefix_keys=True)
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(broker=broker, store_results=True)
    def do_work() -> int:
        return 99

    start_worker(broker)
    # When an actor stores a result
    message = do_work.send()
    assert backend.get_result(message, block=True) == 99
    # Then the row's key is namespace:queue:actor:message_id
    assert stored_keys(db) == [f"myns:default:do_work:{message.message_id}"]


def test_use_namespace_prefix_keys_default_is_legacy_hash(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, db: Any
) -> None:
    # Given the default backend
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        return 99

    start_worker(results_broker)
    # When an actor stores a result
    message = do_work.send()
    assert result_backend.get_result(message, block=True) == 99
    # Then the row's key is a 32-digit MD5 hex digest, not a readable string
    (key,) = stored_keys(db)
    assert len(key) == 32 and int(key, 16) >= 0
    assert not key.startswith("dramatiq-results:")


def test_actors_can_store_exceptions(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    # Given an actor that stores results and fails without retries
    @dramatiq.actor(broker=results_broker, store_results=True, max_retries=0)
    def do_work() -> None:
        raise RuntimeError("failed")

    start_worker(results_broker)
    # When I send it a message and wait for its result
    message = do_work.send()
    # Then the result is the exception
    with pytest.raises(ResultFailure) as e:
        result_backend.get_result(message, block=True)
    assert str(e.value) == "actor raised RuntimeError: failed"
    assert e.value.orig_exc_type == "RuntimeError"
    assert e.value.orig_exc_msg == "failed"


def test_retrieving_a_result_can_raise_result_missing(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, gates: Any
) -> None:
    # Given an actor that is still running when its result is asked for
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        gates["done"].wait(SOON)
        return 42

    start_worker(results_broker)
    message = do_work.send()
    # When I get the result without blocking, then ResultMissing is raised
    with pytest.raises(ResultMissing):
        result_backend.get_result(message)
    gates["done"].set()
    assert result_backend.get_result(message, block=True) == 42


def test_retrieving_a_result_can_time_out(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, gates: Any
) -> None:
    # Given an actor that is still running when its result is asked for
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        gates["done"].wait(SOON)
        return 42

    start_worker(results_broker)
    message = do_work.send()
    # When I wait for the result with a timeout, then ResultTimeout is raised
    with pytest.raises(ResultTimeout):
        result_backend.get_result(message, block=True, timeout=100)


def test_messages_can_get_results_from_backend(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        return 42

    start_worker(results_broker)
    # When I send a message, then the message gets its result from the backend
    message = do_work.send()
    assert message.get_result(backend=result_backend, block=True) == 42


def test_messages_can_get_results_from_inferred_backend(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        return 42

    start_worker(results_broker)
    # When I send a message, then it finds the backend through the global broker
    message = do_work.send()
    assert dramatiq.get_broker() is results_broker
    assert message.get_result(block=True) == 42


def test_messages_without_actor_not_crashing_lookup_options(
    results_broker: PostgresBroker, result_backend: PostgresBackend, db: Any
) -> None:
    # Given a message of an actor the broker does not know
    message: Message[Any] = Message(
        queue_name="default", actor_name="idontexist", args=(), kwargs={}, options={}
    )
    # When the middleware sees it nacked, then nothing fails and nothing is stored
    assert Results(backend=result_backend).after_nack(results_broker, message) is None
    assert stored_keys(db) == []


def test_messages_can_fail_to_get_results_if_there_is_no_backend(make_broker: Any, start_worker: Any) -> None:
    # Given a broker without the Results middleware
    broker = make_broker()

    @dramatiq.actor(broker=broker)
    def do_work() -> int:
        return 42

    start_worker(broker)
    message = do_work.send()
    # When I ask for a result, then a RuntimeError says there is no backend
    with pytest.raises(RuntimeError):
        message.get_result()


def test_actor_no_warning_when_returns_none(
    make_broker: Any, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = make_broker()

    @dramatiq.actor(broker=broker)
    def nothing() -> None:
        pass

    worker = start_worker(broker)
    nothing.send()
    broker.join(nothing.queue_name, timeout=SOON * 1000)
    worker.join()
    assert not any("Consider adding the Results middleware" in m for m in warnings_of(caplog))


def test_actor_warning_when_returns_result_and_no_results_middleware_present(
    make_broker: Any, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = make_broker()

    @dramatiq.actor(broker=broker)
    def always_1() -> int:
        return 1

    worker = start_worker(broker)
    always_1.send()
    broker.join(always_1.queue_name, timeout=SOON * 1000)
    worker.join()
    assert any("Consider adding the Results middleware" in m for m in warnings_of(caplog))


def test_actor_warning_when_returns_result_and_store_results_is_not_set(
    results_broker: PostgresBroker, start_worker: Any, caplog: pytest.LogCaptureFixture, db: Any
) -> None:
    # Given a PostgresBackend and an actor that returns a value without store_results
    @dramatiq.actor(broker=results_broker)
    def always_1() -> int:
        return 1

    worker = start_worker(results_broker)
    always_1.send()
    results_broker.join(always_1.queue_name, timeout=SOON * 1000)
    worker.join()
    # Then the value is discarded with a warning, and nothing is stored
    assert any("the value has been discarded" in m for m in warnings_of(caplog))
    assert stored_keys(db) == []


def test_actor_no_warning_when_returns_result_while_piping_and_store_results_is_not_set(
    results_broker: PostgresBroker, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    @dramatiq.actor(broker=results_broker)
    def always_1() -> int:
        return 1

    @dramatiq.actor(broker=results_broker)
    def noop(x: int) -> None:
        pass

    worker = start_worker(results_broker)
    (always_1.message() | noop.message()).run()
    results_broker.join(always_1.queue_name, timeout=SOON * 1000)
    worker.join()
    assert not any("the value has been discarded" in m for m in warnings_of(caplog))


def test_actor_no_warning_when_returns_result_while_piping(
    make_broker: Any, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = make_broker()

    @dramatiq.actor(broker=broker)
    def always_1() -> int:
        return 1

    @dramatiq.actor(broker=broker)
    def noop(x: int) -> None:
        pass

    worker = start_worker(broker)
    (always_1.message() | noop.message()).run()
    broker.join(noop.queue_name, timeout=SOON * 1000)
    worker.join()
    assert not any("Consider adding the Results middleware" in m for m in warnings_of(caplog))


def test_actor_no_warning_when_returns_result_and_results_middleware_present(
    results_broker: PostgresBroker, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def always_1() -> int:
        return 1

    worker = start_worker(results_broker)
    always_1.send()
    results_broker.join(always_1.queue_name, timeout=SOON * 1000)
    worker.join()
    assert not any("Consider adding the Results middleware" in m for m in warnings_of(caplog))


def test_age_limit_skipped_messages_store_consistent_exceptions(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    # Given an actor that stores results, with a 1 ms age limit
    @dramatiq.actor(broker=results_broker, store_results=True, max_age=1)
    def do_work() -> int:
        return 42

    start_worker(results_broker)
    # When a message older than that is processed (AgeLimit skips and fails it)
    message = do_work.send_with_options(args=[], kwargs={}, delay=2)
    # Then its result is the SkipMessage exception
    with pytest.raises(ResultFailure) as first:
        result_backend.get_result(message, block=True)
    assert str(first.value) == "actor raised SkipMessage: Message age limit exceeded"
    assert first.value.orig_exc_type == "SkipMessage"
    assert first.value.orig_exc_msg == "Message age limit exceeded"
    # And reading it again gives the same exception
    with pytest.raises(ResultFailure) as second:
        result_backend.get_result(message)
    assert (str(second.value), second.value.orig_exc_type, second.value.orig_exc_msg) == (
        str(first.value),
        first.value.orig_exc_type,
        first.value.orig_exc_msg,
    )


def test_custom_skipped_messages_with_no_fail_stores_none(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    # Given a middleware that skips messages without failing them
    class SkipMiddleware(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            raise SkipMessage("Custom skip")

    results_broker.add_middleware(SkipMiddleware())

    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_work() -> int:
        return 42

    start_worker(results_broker)
    # When a message is skipped, then its result is None, and stays None
    message = do_work.send()
    assert result_backend.get_result(message, block=True) is None
    assert result_backend.get_result(message) is None
    assert message.get_result() is None


# -- Dramatiq's tests/test_composition.py, the cases with results -------------


def test_pipe_ignore_applies_to_receiving_message(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def return_args(*args: Any) -> Any:
        return args

    start_worker(results_broker)
    # When the second message of a pipeline ignores the first one's result
    pipe = (
        return_args.message(1)
        | return_args.message_with_options(pipe_ignore=True, args=(2,))
        | return_args.message(3)
    )
    pipe.run()
    # Then it gets no argument from the first, and the third gets the second's result
    assert list(pipe.get_results(block=True, timeout=SOON * 1000)) == [[1], [2], [3, [2]]]


def test_pipeline_results_can_be_retrieved(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def add(x: int, y: int) -> int:
        return x + y

    start_worker(results_broker)
    # When I run a pipeline (with a nested one)
    pipe = add.message(1, 2) | (add.message(3) | add.message(4))
    pipe.run()
    # Then its result is the last one, and each step's result can be read
    assert pipe.get_result(block=True, timeout=SOON * 1000) == 10
    assert list(pipe.get_results()) == [3, 6, 10]


def test_pipeline_results_respect_timeouts(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, gates: Any
) -> None:
    # Given an actor that does not finish before the test releases it
    @dramatiq.actor(broker=results_broker, store_results=True)
    def wait(n: int) -> int:
        gates["done"].wait(SOON)
        return n * 2

    start_worker(results_broker)
    pipe = wait.message(1) | wait.message() | wait.message()
    pipe.run()
    # When I get the results with a timeout shorter than the pipeline, then ResultTimeout is raised
    with pytest.raises(ResultTimeout):
        for _ in pipe.get_results(block=True, timeout=1000):
            pass


def test_pipelines_expose_completion_stats(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, gates: Any
) -> None:
    # Given an actor whose messages finish when the test releases them, one by one
    @dramatiq.actor(broker=results_broker, store_results=True)
    def wait(n: int) -> int:
        gates[n].wait(SOON)
        return n + 1

    start_worker(results_broker)
    pipe = wait.message(1) | wait.message()
    pipe.run()
    assert pipe.completed_count == 0
    # Then every time a job of the pipeline completes, completed_count grows by one
    for n in range(1, len(pipe) + 1):
        gates[n].set()
        wait_for(lambda n=n: pipe.completed_count == n, SOON, f"{n} completed")  # type: ignore[misc]
    # And the pipeline is completed
    assert pipe.completed


def test_pipelines_can_be_incomplete(results_broker: PostgresBroker, result_backend: PostgresBackend) -> None:
    # Given no worker running
    @dramatiq.actor(broker=results_broker, store_results=True)
    def do_nothing() -> None:
        return None

    # When I run a pipeline, then it is not completed
    pipe = do_nothing.message() | do_nothing.message_with_options(pipe_ignore=True)
    pipe.run()
    assert not pipe.completed


def test_groups_execute_jobs_in_parallel(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    # Given an actor that finishes only once all four run at the same time
    barrier = threading.Barrier(4, timeout=SOON)

    @dramatiq.actor(broker=results_broker, store_results=True, max_retries=0)
    def wait() -> None:
        barrier.wait()

    start_worker(results_broker, worker_threads=4)
    # When I run a group of four
    g = group([wait.message() for _ in range(4)], broker=results_broker)
    g.run()
    # Then all four ran in parallel (a broken barrier would store a ResultFailure)
    results = list(g.get_results(block=True, timeout=SOON * 1000 * 2))
    assert results == [None] * 4
    assert g.completed


def test_groups_execute_inner_groups(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def wait() -> None:
        pass

    start_worker(results_broker)
    # When I run a group of three groups of two
    g = group((group(wait.message() for _ in range(2)) for _ in range(3)), broker=results_broker)
    g.run()
    # Then I get three lists of two results, and the group is completed
    assert list(g.get_results(block=True, timeout=SOON * 1000)) == [[None, None]] * 3
    assert g.completed


def test_groups_can_time_out(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, gates: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def wait() -> None:
        gates["done"].wait(SOON)

    start_worker(results_broker)
    g = group((wait.message() for _ in range(2)), broker=results_broker)
    g.run()
    # When I wait for the group with a timeout it cannot meet, then ResultTimeout is raised
    with pytest.raises(ResultTimeout):
        g.wait(timeout=100)
    # And the group is not completed
    assert not g.completed


def test_groups_expose_completion_stats(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, gates: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def wait(n: int) -> int:
        gates[n].wait(SOON)
        return n

    start_worker(results_broker)
    g = group((wait.message(n) for n in range(1, 4)), broker=results_broker)
    g.run()
    # Then every time a job of the group completes, completed_count grows by one
    for n in range(1, len(g) + 1):
        gates[n].set()
        wait_for(lambda n=n: g.completed_count == n, SOON, f"{n} completed")  # type: ignore[misc]
    assert g.completed


def test_groups_completion_count_works_for_tasks_finishing_out_of_order(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, gates: Any
) -> None:
    # Dramatiq issue #452: jobs that finish in another order than the group's.
    @dramatiq.actor(broker=results_broker, store_results=True)
    def wait(n: int) -> int:
        gates[n].wait(SOON)
        return n

    start_worker(results_broker)
    g = group((wait.message(n) for n in (1, 2, 3)), broker=results_broker)
    g.run()
    for done, n in enumerate((2, 3, 1), start=1):
        gates[n].set()
        wait_for(lambda done=done: g.completed_count == done, SOON, f"{done} completed")  # type: ignore[misc]
    assert g.completed


def test_pipeline_respects_own_delay(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def add(x: int, y: int = 0) -> int:
        return x + y

    start_worker(results_broker)
    # When a pipeline runs with a delay longer than the timeout, then ResultTimeout is raised
    pipe = add.message(1, 2) | add.message(3)
    pipe.run(delay=10_000)
    with pytest.raises(ResultTimeout):
        for _ in pipe.get_results(block=True, timeout=100):
            pass


def test_pipeline_respects_delay_of_first_message(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def add(x: int, y: int = 0) -> int:
        return x + y

    start_worker(results_broker)
    pipe = add.message_with_options(args=(1, 2), delay=10_000) | add.message(3)
    pipe.run()
    with pytest.raises(ResultTimeout):
        for _ in pipe.get_results(block=True, timeout=100):
            pass


def test_pipeline_respects_delay_of_second_message(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def add(x: int, y: int = 0) -> int:
        return x + y

    start_worker(results_broker)
    pipe = add.message(1, 2) | add.message_with_options(args=(3,), delay=10_000)
    pipe.run()
    with pytest.raises(ResultTimeout):
        for _ in pipe.get_results(block=True, timeout=100):
            pass
    # The first step completes; the second waits for its delay
    wait_for(lambda: pipe.completed_count == 1, SOON, "the first step")
    assert not pipe.completed


def test_pipeline_respects_bigger_of_first_messages_and_pipelines_delay(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    @dramatiq.actor(broker=results_broker, store_results=True)
    def add(x: int, y: int = 0) -> int:
        return x + y

    start_worker(results_broker)
    pipe = add.message_with_options(args=(1, 2), delay=100) | add.message(3)
    pipe.run(delay=10_000)
    with pytest.raises(ResultTimeout):
        for _ in pipe.get_results(block=True, timeout=300):
            pass


# -- store_results per actor, retries -----------------------------------------


def test_store_results_is_chosen_per_actor_and_per_message(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, db: Any
) -> None:
    # Given one actor that stores results and one that does not (the middleware's default)
    @dramatiq.actor(broker=results_broker, store_results=True)
    def kept() -> str:
        return "kept"

    @dramatiq.actor(broker=results_broker)
    def dropped() -> str:
        return "dropped"

    start_worker(results_broker)
    # When both run, and the second once more with store_results as a message option
    a, b = kept.send(), dropped.send()
    c = dropped.send_with_options(store_results=True)
    results_broker.join("default", timeout=SOON * 1000)
    # Then only the results asked for are stored
    assert result_backend.get_result(a) == "kept"
    assert result_backend.get_result(c) == "dropped"
    with pytest.raises(ResultMissing):
        result_backend.get_result(b)
    assert len(stored_keys(db)) == 2


def test_a_retried_message_stores_the_result_of_its_last_attempt(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, db: Any
) -> None:
    # Given an actor that fails twice, then succeeds, with quick retries
    attempts: list[int] = []

    @dramatiq.actor(broker=results_broker, store_results=True, max_retries=3, min_backoff=10, max_backoff=50)
    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ValueError(f"attempt {len(attempts)}")
        return "third time"

    start_worker(results_broker)
    # When it runs, then the stored result is the successful one, from the third run
    message = flaky.send()
    assert result_backend.get_result(message, block=True, timeout=SOON * 1000) == "third time"
    assert len(attempts) == 3
    # And the failed runs stored nothing of their own: one row for the message
    assert stored_keys(db) == [result_backend.build_message_key(message)]


def test_a_message_that_exhausts_its_retries_stores_its_exception(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any
) -> None:
    runs: list[int] = []

    @dramatiq.actor(broker=results_broker, store_results=True, max_retries=2, min_backoff=10, max_backoff=50)
    def hopeless() -> None:
        runs.append(1)
        raise ValueError("nope")

    start_worker(results_broker)
    # When all its retries fail, then the exception of the last one is the result
    message = hopeless.send()
    with pytest.raises(ResultFailure) as e:
        result_backend.get_result(message, block=True, timeout=SOON * 1000)
    assert (e.value.orig_exc_type, e.value.orig_exc_msg) == ("ValueError", "nope")
    assert len(runs) == 3


# -- TTL and cleanup ----------------------------------------------------------


def test_results_expire_after_their_ttl(
    results_broker: PostgresBroker, result_backend: PostgresBackend, start_worker: Any, db: Any
) -> None:
    # Given an actor whose results live for one second
    @dramatiq.actor(broker=results_broker, store_results=True, result_ttl=1_000)
    def do_work() -> int:
        return 42

    start_worker(results_broker)
    message = do_work.send()
    assert result_backend.get_result(message, block=True) == 42

    # When the TTL has passed on the database clock
    def expired() -> bool:
        try:
            result_backend.get_result(message)
        except ResultMissing:
            return True
        return False

    wait_for(expired, SOON, "the result to expire")
    # Then readers no longer see it although its row is still there (no cleanup ran)
    assert count(db, "SELECT count(*) FROM dramatiq.results WHERE expires_at <= now()") == 1
    with pytest.raises(ResultTimeout):
        result_backend.get_result(message, block=True, timeout=100)
    # And the cleanup deletes it
    assert result_backend.delete_expired() == 1
    assert stored_keys(db) == []


def test_delete_expired_deletes_in_batches_and_keeps_live_results(
    make_broker: Any, make_backend: Any, db: Any
) -> None:
    # Given five expired results and two live ones
    backend = make_backend(broker=make_broker())
    messages = [Message(queue_name="q", actor_name="a", args=(i,), kwargs={}, options={}) for i in range(7)]
    for i, message in enumerate(messages):
        backend.store_result(message, i, 0 if i < 5 else 600_000)
    # When the cleanup runs with batches of two
    deleted = backend.delete_expired(batch_size=2)
    # Then it deleted all five (three statements) and kept the live two
    assert deleted == 5
    assert count(db, "SELECT count(*) FROM dramatiq.results") == 2
    assert [backend.get_result(m) for m in messages[5:]] == [5, 6]
    assert backend.delete_expired() == 0


def test_expired_rows_are_deleted_by_the_background_cleanup(
    make_broker: Any, make_backend: Any, db: Any
) -> None:
    # Given a backend that cleans up every 200 ms in each process that stores results
    backend = make_backend(broker=make_broker(), cleanup_interval=200)
    messages = [Message(queue_name="q", actor_name="a", args=(i,), kwargs={}, options={}) for i in range(4)]
    # When it stores three results that are already expired and one that is not
    for i, message in enumerate(messages):
        backend.store_result(message, i, 0 if i < 3 else 600_000)
    # Then the expired rows disappear without anyone calling delete_expired
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.results") == 1, SOON, "the cleanup")
    assert backend.get_result(messages[3]) == 3


# -- NOTIFY wake-up, polling, pool, errors ------------------------------------


def test_a_blocked_reader_is_woken_by_the_notification_of_the_store(
    make_broker: Any, make_backend: Any, start_worker: Any, gates: Any
) -> None:
    # Given a backend whose readers poll only once a minute
    broker = make_broker()
    backend = make_backend(broker=broker, poll_interval=60_000)
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(broker=broker, store_results=True)
    def do_work() -> int:
        gates["done"].wait(SOON)
        return 42

    start_worker(broker)
    message = do_work.send()
    got: list[Any] = []
    reader = threading.Thread(
        target=lambda: got.append(backend.get_result(message, block=True, timeout=120_000))
    )
    reader.start()
    # And a reader that has read the table under LISTEN and now waits
    wait_for(lambda: backend.waiting == 1, SOON, "the reader to wait on its notification")
    # When the actor finishes and its result is stored
    gates["done"].set()
    # Then the reader returns long before its next poll would have found the result
    reader.join(SOON)
    assert not reader.is_alive(), "the reader was not woken by the store's NOTIFY"
    assert got == [42]


def test_a_result_stored_before_the_reader_blocks_is_found_without_a_notification(
    make_broker: Any, make_backend: Any
) -> None:
    # Given a result already stored, and a backend whose readers poll only once a minute
    backend = make_backend(broker=make_broker(), poll_interval=60_000)
    message: Message[Any] = Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    backend.store_result(message, "early", 600_000)
    # When a reader blocks on it, then it reads the table before it waits
    got: list[Any] = []
    reader = threading.Thread(
        target=lambda: got.append(backend.get_result(message, block=True, timeout=120_000))
    )
    reader.start()
    reader.join(SOON)
    assert not reader.is_alive()
    assert got == ["early"]


def test_readers_poll_when_listen_is_off(
    make_broker: Any, make_backend: Any, start_worker: Any, db: Any
) -> None:
    # Given a backend that does not LISTEN (as behind transaction-mode PgBouncer)
    broker = make_broker()
    backend = make_backend(broker=broker, listen=False, poll_interval=200)
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(broker=broker, store_results=True)
    def do_work() -> int:
        return 42

    start_worker(broker)
    # When a reader blocks on a result, then it gets it by polling
    assert backend.get_result(do_work.send(), block=True, timeout=SOON * 1000) == 42
    # And no results listener was opened
    assert not backend.listening
    assert (
        count(
            db,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE '%%:results'",
        )
        == 0
    )


def test_the_backend_uses_the_broker_pool(make_broker: Any, make_backend: Any, db: Any) -> None:
    # Given a backend built on a broker
    broker = make_broker()
    backend = make_backend(broker=broker)
    message: Message[Any] = Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    before = broker.runtime.pool.get_stats().get("requests_num", 0)
    # When it stores and reads a result
    backend.store_result(message, 1, 60_000)
    assert backend.get_result(message) == 1
    # Then both went through the broker's pool
    assert broker.runtime.pool.get_stats().get("requests_num", 0) - before >= 2


def test_a_backend_connects_lazily_and_raises_dramatiq_connection_errors() -> None:
    # Given a backend on a server that does not answer: constructing it connects to nothing
    backend = PostgresBackend(url="postgresql://postgres@127.0.0.1:1/nothing", pool_timeout=500)
    message: Message[Any] = Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    try:
        # When it is used, then the error is Dramatiq's connection error
        with pytest.raises(BrokerConnectionError):
            backend.store_result(message, 1, 60_000)
        with pytest.raises(BrokerConnectionError):
            backend.get_result(message)
    finally:
        backend.close()


def test_a_missing_or_old_schema_raises_schema_not_ready_naming_the_fix(database_url: str) -> None:
    message: Message[Any] = Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    # Given a schema that was never migrated, and one at revision 0003 (before the results table)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS results_none CASCADE; DROP SCHEMA IF EXISTS results_old CASCADE")
    upgrade(database_url, schema="results_old", revision="0003")
    try:
        for schema, match in (("results_none", "do not exist"), ("results_old", f"needs {SCHEMA_REVISION}")):
            backend = PostgresBackend(url=database_url, schema=schema)
            # When a result is read or stored, then SchemaNotReady names the command that fixes it
            with pytest.raises(SchemaNotReady, match=match) as e:
                backend.get_result(message)
            # (the broker's URL has no password: the command names it, ready to paste)
            assert f"dramatiq-pg-outbox migrate --url {database_url} --schema {schema}" in str(e.value)
            with pytest.raises(SchemaNotReady):
                backend.store_result(message, 1, 1_000)
            backend.close()
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS results_old CASCADE")


def test_a_dropped_results_table_raises_schema_not_ready(database_url: str) -> None:
    # Given a schema at the current revision whose results table was dropped by hand
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS results_dropped CASCADE")
    upgrade(database_url, schema="results_dropped")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE results_dropped.results")
    backend = PostgresBackend(url=database_url, schema="results_dropped")
    message: Message[Any] = Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    try:
        # When a result is read, then SchemaNotReady names the table and the command
        with pytest.raises(SchemaNotReady, match=r"results_dropped\.results does not exist.*migrate"):
            backend.get_result(message)
    finally:
        backend.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DROP SCHEMA results_dropped CASCADE")


def test_revision_0004_adds_the_results_table_and_downgrades_cleanly(database_url: str) -> None:
    def results_table(conn: Any) -> bool:
        return bool(conn.execute("SELECT to_regclass('results_mig.results') IS NOT NULL").fetchone()[0])

    def comment(conn: Any) -> str:
        return str(conn.execute("SELECT obj_description('results_mig.messages'::regclass)").fetchone()[0])

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS results_mig CASCADE")
        upgrade(database_url, schema="results_mig", revision="0003")
        assert not results_table(conn)
        upgrade(database_url, schema="results_mig", revision="0004")
        assert results_table(conn) and comment(conn).endswith("revision 4")
        downgrade(database_url, schema="results_mig", revision="0003")
        assert not results_table(conn) and comment(conn).endswith("revision 3")
        upgrade(database_url, schema="results_mig")
        assert results_table(conn)
        conn.execute("DROP SCHEMA results_mig CASCADE")


# -- the whole stack ----------------------------------------------------------

#: A worker module for the ``dramatiq`` CLI: broker and results on PostgreSQL only.
STACK_APP = """
import os
import sys

import dramatiq
from dramatiq.results import Results

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.results import PostgresBackend

broker = PostgresBroker(url=os.environ["DPO_TEST_URL"], max_fetch_interval=200)
broker.add_middleware(Results(backend=PostgresBackend(broker=broker)))
dramatiq.set_broker(broker)


@dramatiq.actor(store_results=True, queue_name="results_stack")
def add(x, y=0):
    return x + y


@dramatiq.actor(store_results=True, queue_name="results_stack")
def redis_modules():
    return sorted(name for name in sys.modules if name == "redis" or name.startswith("redis."))
"""


def test_a_full_dramatiq_stack_needs_no_redis(
    make_broker: Any, make_backend: Any, database_url: str, tmp_path: Path
) -> None:
    # Given `dramatiq` CLI workers (2 forked processes) whose broker and results are PostgreSQL
    (tmp_path / "results_stack_app.py").write_text(textwrap.dedent(STACK_APP))
    env = {
        **os.environ,
        "DPO_TEST_URL": database_url,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    cli = [sys.executable, "-m", "dramatiq", "results_stack_app", "--processes", "2", "--threads", "2"]
    proc = subprocess.Popen(cli, cwd=ROOT, env=env, start_new_session=True)
    try:
        # And a producer with the same actors and a PostgresBackend of its own
        broker = make_broker()
        backend = make_backend(url=database_url)
        broker.add_middleware(Results(backend=backend))

        @dramatiq.actor(broker=broker, store_results=True, queue_name="results_stack")
        def add(x: int, y: int = 0) -> int:
            raise AssertionError("runs in the workers")

        @dramatiq.actor(broker=broker, store_results=True, queue_name="results_stack")
        def redis_modules() -> list[str]:
            raise AssertionError("runs in the workers")

        # When it runs a pipeline, a group and a single message, waiting on their results
        pipe = (add.message(1, 2) | add.message(3) | add.message(4)).run()
        g = group((add.message(i, i) for i in range(10)), broker=broker).run()
        probe = redis_modules.send()
        # Then every result comes back through PostgreSQL
        assert pipe.get_result(block=True, timeout=60_000) == 10
        assert list(g.get_results(block=True, timeout=60_000)) == [2 * i for i in range(10)]
        # And no worker process ever imported a Redis client
        assert probe.get_result(block=True, timeout=60_000) == []
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
