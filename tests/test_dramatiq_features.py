"""Dramatiq's own features keep working on the broker: middleware, composition, results, encoders."""

from __future__ import annotations

import time
from typing import Any

import dramatiq
import pytest
from dramatiq import group, pipeline
from dramatiq.encoder import JSONEncoder, PickleEncoder
from dramatiq.middleware import TimeLimitExceeded
from dramatiq.results import Results
from dramatiq.results.backends import StubBackend

from dramatiq_pg_outbox import PostgresBroker

from .helpers import wait_for


def test_pipelines_pass_results_along(broker: PostgresBroker, start_worker: Any) -> None:
    out: list[int] = []

    @dramatiq.actor(broker=broker)
    def add(x: int, y: int) -> int:
        return x + y

    @dramatiq.actor(broker=broker)
    def collect(x: int) -> None:
        out.append(x)

    pipeline([add.message(1, 2), add.message(10), collect.message()], broker=broker).run()
    start_worker(broker)
    wait_for(lambda: bool(out), 10, "the pipeline's last step")
    assert out == [13]


def test_groups_and_results_with_a_results_backend(make_broker: Any, start_worker: Any) -> None:
    backend = StubBackend()
    broker = make_broker()
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(broker=broker, store_results=True)
    def square(x: int) -> int:
        return x * x

    start_worker(broker)
    g = group(square.message(i) for i in range(10)).run()
    assert sorted(g.get_results(block=True, timeout=10_000)) == [i * i for i in range(10)]
    message = square.send(7)
    assert message.get_result(backend=backend, block=True, timeout=10_000) == 49


def test_callbacks_on_success_and_failure(broker: PostgresBroker, start_worker: Any) -> None:
    events: list[str] = []

    @dramatiq.actor(broker=broker)
    def on_ok(message: dict[str, Any], result: Any) -> None:
        events.append(f"ok:{result}")

    @dramatiq.actor(broker=broker)
    def on_fail(message: dict[str, Any], exception: dict[str, Any]) -> None:
        events.append(f"fail:{exception['type']}")

    @dramatiq.actor(broker=broker, max_retries=0)
    def work(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x

    work.send_with_options(args=(5,), on_success=on_ok, on_failure=on_fail)
    work.send_with_options(args=(-1,), on_success=on_ok, on_failure=on_fail)
    start_worker(broker)
    wait_for(lambda: len(events) >= 2, 10, "both callbacks")
    assert sorted(events) == ["fail:ValueError", "ok:5"]


def test_age_limit_skips_expired_messages(broker: PostgresBroker, start_worker: Any, db: Any) -> None:
    ran: list[int] = []

    @dramatiq.actor(broker=broker, max_age=100)
    def fresh_only(x: int) -> None:
        ran.append(x)

    fresh_only.send(1)
    time.sleep(0.3)
    start_worker(broker)
    broker.join("default", timeout=10_000)
    assert ran == []
    # AgeLimit fails the message: it is dead-lettered.
    assert db.execute("SELECT state FROM dramatiq.history").fetchall() == [("failed",)]


def test_time_limit_interrupts_a_slow_actor(broker: PostgresBroker, start_worker: Any, db: Any) -> None:
    @dramatiq.actor(broker=broker, time_limit=200, max_retries=0)
    def slow() -> None:
        for _ in range(100):
            time.sleep(0.05)

    slow.send()
    # The dramatiq CLI emits process_boot, which starts TimeLimit's monitor thread.
    broker.emit_after("process_boot")
    start_worker(broker)
    broker.join("default", timeout=15_000)
    ((state, error_type),) = db.execute("SELECT state, error_type FROM dramatiq.history").fetchall()
    assert (state, error_type) == ("failed", TimeLimitExceeded.__name__)


@pytest.fixture
def pickle_encoder() -> Any:
    dramatiq.set_encoder(PickleEncoder())
    yield
    dramatiq.set_encoder(JSONEncoder())


def test_a_custom_encoder_round_trips(pickle_encoder: Any, broker: PostgresBroker, start_worker: Any) -> None:
    seen: list[Any] = []

    @dramatiq.actor(broker=broker)
    def take(value: Any) -> None:
        seen.append(value)

    value = {"when": (2026, 11, 21), "tags": {"a", "b"}, "raw": b"\x00\xff"}
    take.send(value)
    start_worker(broker)
    broker.join("default", timeout=10_000)
    assert seen == [value]


class _Recorder(dramatiq.Middleware):
    """Records the hooks it overrides; its ``before_ack`` fails once, as a faulty middleware would."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events
        self.failed = False

    def before_process_message(self, broker: Any, message: Any) -> None:
        self.events.append(f"{self.name}:before_process_message:{message.actor_name}")

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        self.events.append(f"{self.name}:after_process_message")

    def before_ack(self, broker: Any, message: Any) -> None:
        self.events.append(f"{self.name}:before_ack")
        if not self.failed:
            self.failed = True
            raise RuntimeError("a faulty middleware")


def test_only_the_hooks_a_middleware_overrides_run_in_dramatiqs_order(
    broker: PostgresBroker, start_worker: Any
) -> None:
    """The broker runs each signal's hooks as Dramatiq's emit_before/emit_after do (list order
    before, reverse order after, a failing hook logged and skipped), but never Middleware's
    empty default hooks (found once per middleware list); a middleware added later is seen."""
    import sys
    import threading

    events: list[str] = []
    broker.add_middleware(_Recorder("a", events))
    broker.add_middleware(_Recorder("b", events))
    defaults = {
        getattr(dramatiq.Middleware, name).__code__
        for name in dir(dramatiq.Middleware)
        if name.startswith(("before_", "after_"))
    }
    default_calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in defaults:
            default_calls.append(frame.f_code.co_name)

    @dramatiq.actor(broker=broker, queue_name="hooks-order")
    def step() -> None:
        pass

    threading.setprofile(profile)
    try:
        start_worker(broker)
        step.send()
        wait_for(lambda: "a:after_process_message" in events, 10, "the first message's hooks")
        broker.add_middleware(_Recorder("c", events))
        step.send()
        wait_for(lambda: "c:after_process_message" in events, 10, "the hooks of a middleware added later")
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
    first = events[: events.index("a:before_ack") + 2]
    assert first == [
        "a:before_process_message:step",
        "b:before_process_message:step",
        "b:after_process_message",
        "a:after_process_message",
        "a:before_ack",  # it raised: logged, and b's hook still runs
        "b:before_ack",
    ]
    assert "c:before_process_message:step" in events
    assert default_calls == [], f"Middleware's empty hooks were called: {sorted(set(default_calls))}"
