"""The outbox relay against the real RabbitMQ (127.0.0.1:5672) and Redis (127.0.0.1:6379).

Messages are written through ``outbox(session)`` or ``enqueue_many`` into PostgreSQL;
a relay (in a thread, or the ``dramatiq-pg-outbox relay`` command in a process) moves
them; an ordinary Dramatiq worker of ``RabbitmqBroker`` / ``RedisBroker`` runs them.
Every queue and Redis namespace is the test's own and is deleted after it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.relay import Relay

from .helpers import Proxy, count, reachable, wait_for

pika = pytest.importorskip("pika", reason="the relay tests need pika (pip install 'dramatiq[rabbitmq]')")
redis = pytest.importorskip("redis", reason="the relay tests need redis (pip install 'dramatiq[redis]')")
from dramatiq.brokers.rabbitmq import RabbitmqBroker  # noqa: E402
from dramatiq.brokers.redis import RedisBroker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AMQP = os.environ.get("DPO_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
REDIS = os.environ.get("DPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


class Received:
    """What the target's worker ran: every key, duplicates included (thread-safe)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self.keys.append(key)

    def distinct(self) -> set[str]:
        with self._lock:
            return set(self.keys)

    def duplicates(self) -> int:
        with self._lock:
            return sum(n - 1 for n in Counter(self.keys).values())


class Target:
    """A target broker of the test's own (queue or namespace), its consumer worker, its cleanup."""

    def __init__(self, kind: str, queue: str) -> None:
        self.kind = kind
        self.queue = queue
        self.namespace = f"dpo-test-{uuid.uuid4().hex[:8]}"
        self.received = Received()
        self.consumer_broker = self.make()
        self.worker: dramatiq.Worker | None = None
        dramatiq.actor(self.received.add, broker=self.consumer_broker, queue_name=queue, actor_name="relayed")

    def make(self, url: str | None = None) -> Any:
        if self.kind == "rabbitmq":
            return RabbitmqBroker(url=url or AMQP, confirm_delivery=True)
        return RedisBroker(url=url or REDIS, namespace=self.namespace)

    def url(self) -> str:
        return AMQP if self.kind == "rabbitmq" else REDIS

    def start_worker(self) -> None:
        self.worker = dramatiq.Worker(self.consumer_broker, worker_threads=4, worker_timeout=100)
        self.worker.start()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop(timeout=10_000)
        self.consumer_broker.close()
        if self.kind == "rabbitmq":
            conn = pika.BlockingConnection(pika.URLParameters(AMQP))
            try:
                channel = conn.channel()
                for name in (self.queue, f"{self.queue}.DQ", f"{self.queue}.XQ"):
                    channel.queue_delete(name)
            finally:
                conn.close()
        else:
            client = redis.Redis.from_url(REDIS)
            keys = list(client.scan_iter(f"{self.namespace}*"))
            if keys:
                client.delete(*keys)
            client.close()


@pytest.fixture
def make_target() -> Iterator[Callable[[str], Target]]:
    targets: list[Target] = []

    def make(kind: str) -> Target:
        host, port = ("127.0.0.1", 5672) if kind == "rabbitmq" else ("127.0.0.1", 6379)
        if not reachable(host, port):
            pytest.skip(f"no {kind} server at {host}:{port}")
        target = Target(kind, f"relay_{uuid.uuid4().hex[:10]}")
        targets.append(target)
        return target

    try:
        yield make
    finally:
        for target in targets:
            target.close()


class RelayThread:
    """A Relay in a thread of the test process."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.thread = threading.Thread(target=relay.run, name="relay", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.relay.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


def producer_actor(broker: PostgresBroker, queue: str) -> Any:
    return dramatiq.actor(lambda key: None, broker=broker, queue_name=queue, actor_name="relayed")


@pytest.mark.parametrize("kind", ["rabbitmq", "redis"])
def test_exactly_the_committed_messages_are_consumed_by_the_targets_worker(
    kind: str, database_url: str, db: Any, broker: PostgresBroker, make_target: Any
) -> None:
    target = make_target(kind)
    send = producer_actor(broker, target.queue)
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    db.execute("CREATE TABLE IF NOT EXISTS signups (key text PRIMARY KEY)")
    db.execute("TRUNCATE signups")
    relay = RelayThread(Relay(broker, target.make(), [target.queue], batch_size=7))
    try:
        target.start_worker()
        # Given 40 transactions that send a message beside a business row: 25 commit, 15 roll back
        committed, rolled_back = set(), set()
        for i in range(40):
            key = f"signup-{i}"
            with Session(engine) as session, outbox(session):
                session.execute(text("INSERT INTO signups VALUES (:k)"), {"k": key})
                send.send(key)
                if i % 8 < 5:
                    session.commit()
                    committed.add(key)
                else:
                    session.rollback()
                    rolled_back.add(key)
        # Then the target's worker runs exactly the committed ones
        wait_for(lambda: target.received.distinct() == committed, 60, "the committed messages consumed")
        wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 10, "the outbox emptied")
        assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'completed'") == len(committed)
        assert {r[0] for r in db.execute("SELECT key FROM signups").fetchall()} == committed
        assert target.received.duplicates() == 0 and not (target.received.distinct() & rolled_back)
        assert relay.relay.stats.relayed == len(committed)
    finally:
        relay.stop()
        engine.dispose()


def test_delayed_messages_are_relayed_when_due_in_order(
    db: Any, broker: PostgresBroker, make_target: Any
) -> None:
    target = make_target("rabbitmq")
    send = producer_actor(broker, target.queue)
    relay = RelayThread(Relay(broker, target.make(), [target.queue]))
    try:
        target.start_worker()
        # Given messages due now and one due in 1.5 s, sent first
        started = time.monotonic()
        send.send_with_options(args=("late",), delay=1_500)
        for i in range(5):
            send.send(f"now-{i}")
        # Then the due ones arrive first, the delayed one only once due
        wait_for(lambda: len(target.received.distinct()) == 5, 30, "the due messages")
        assert "late" not in target.received.distinct()
        wait_for(lambda: "late" in target.received.distinct(), 30, "the delayed message")
        assert time.monotonic() - started >= 1.5
    finally:
        relay.stop()


def start_relay_process(database_url: str, to: str, queue: str, log: Path) -> subprocess.Popen[str]:
    with log.open("a") as stderr:
        return subprocess.Popen(
        [sys.executable, "-m", "dramatiq_pg_outbox.cli", "relay", "--url", database_url, "--to", to,
         "--queues", queue, "--batch-size", "200", "--report-every", "2",
         "--heartbeat-interval", "200", "--heartbeat-timeout", "1000"],
        cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
        )  # fmt: skip


def test_a_relay_killed_mid_run_and_restarted_loses_nothing(
    database_url: str, db: Any, broker: PostgresBroker, make_target: Any, tmp_path: Path
) -> None:
    target = make_target("rabbitmq")
    send = producer_actor(broker, target.queue)
    log = tmp_path / "relay.log"
    keys = [f"m{i}" for i in range(20_000)]
    broker.enqueue_many([send.message(k) for k in keys])
    target.start_worker()
    processes: list[subprocess.Popen[str]] = []
    try:
        # Given a relay process moving 20,000 messages
        processes.append(start_relay_process(database_url, target.url(), target.queue, log))
        wait_for(lambda: len(target.received.distinct()) >= 3_000, 120, "3,000 messages relayed")
        # When it is killed -9 mid-run, then started again
        os.killpg(processes[0].pid, signal.SIGKILL)
        processes[0].wait(10)
        at_kill = len(target.received.distinct())
        assert at_kill < 20_000
        processes.append(start_relay_process(database_url, target.url(), target.queue, log))
        # Then every message is consumed; duplicates only from the batch in flight at the kill
        wait_for(lambda: target.received.distinct() == set(keys), 240, "all 20,000 messages consumed")
        wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.messages") == 0, 30, "the outbox emptied")
        assert target.received.duplicates() <= 200
        processes[1].send_signal(signal.SIGTERM)
        assert processes[1].wait(30) == 0, log.read_text()
    finally:
        for proc in processes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_the_relay_command_serves_its_metrics_to_prometheus(
    database_url: str, db: Any, broker: PostgresBroker, make_target: Any, tmp_path: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    target = make_target("redis")
    send = producer_actor(broker, target.queue)
    # Given 300 due messages of a relayed queue, and 5 due in an hour
    broker.enqueue_many([send.message(f"m{i}") for i in range(300)])
    broker.enqueue_many([send.message(f"later{i}") for i in range(5)], delay=3_600_000)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "relay.log"
    with log.open("a") as stderr:
        relay = subprocess.Popen(
            [sys.executable, "-m", "dramatiq_pg_outbox.cli", "relay", "--url", database_url,
             "--to", REDIS, "--queues", target.queue, "--metrics-port", str(port)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
        )  # fmt: skip
    try:
        # When the relay command with --metrics-port has moved them
        wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.history") == 300, 60, "300 archived")

        def scrape() -> dict[str, float]:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                text = response.read().decode()
            return {
                sample.name: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.labels.get("queue_name", target.queue) == target.queue
            }

        # Then its endpoint counts them, and shows no due message waiting (the delayed ones are not due)
        values = scrape()
        assert values["dramatiq_pg_outbox_relay_confirmed_total"] == 300
        assert values["dramatiq_pg_outbox_relay_due_messages"] == 0
        assert values["dramatiq_pg_outbox_relay_lag_seconds"] == 0
        assert values["dramatiq_pg_outbox_relay_target_failures_total"] == 0
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, log.read_text()
        client = redis.Redis.from_url(REDIS)  # the command's RedisBroker uses Dramatiq's namespace
        for key in client.scan_iter(f"dramatiq:{target.queue}*"):
            client.delete(key)
        client.close()


def test_a_target_cut_off_for_10_seconds_loses_nothing(
    db: Any, broker: PostgresBroker, make_target: Any
) -> None:
    target = make_target("rabbitmq")
    send = producer_actor(broker, target.queue)
    keys = [f"m{i}" for i in range(5_000)]
    broker.enqueue_many([send.message(k) for k in keys])
    proxy = Proxy(("127.0.0.1", 5672))
    via_proxy = AMQP.replace("127.0.0.1:5672", f"127.0.0.1:{proxy.port}")
    via_proxy += ("&" if "?" in via_proxy else "?") + "connection_attempts=1&socket_timeout=2"
    relay = RelayThread(Relay(broker, target.make(via_proxy), [target.queue], batch_size=100))
    try:
        target.start_worker()
        # Given a relay publishing through a connection that is cut after 500 messages
        wait_for(lambda: len(target.received.distinct()) >= 500, 60, "500 messages relayed")
        proxy.block()
        cut_at = relay.relay.stats.relayed
        # When RabbitMQ is out of reach for 10 s
        time.sleep(10)
        during = relay.relay.stats.relayed
        proxy.unblock()
        # Then the relay reconnects by itself and every message arrives
        wait_for(lambda: target.received.distinct() == set(keys), 120, "all 5,000 messages consumed")
        assert during - cut_at <= 100  # nothing relayed while cut off, but the batch in flight
        assert relay.relay.stats.target_failures >= 1 and relay.relay.stats.released >= 1
        assert target.received.duplicates() <= 100
    finally:
        relay.stop()
        proxy.close()


def test_the_command_explains_bad_input_in_one_line(database_url: str) -> None:
    base = [sys.executable, "-m", "dramatiq_pg_outbox.cli", "relay", "--url", database_url]
    for extra, message in (
        (["--to", "kafka://x", "--queues", "a"], "--to must be an amqp://"),
        (["--to", AMQP, "--queues", "no spaces"], "--queues:"),
        (["--to", AMQP, "--queues", "a", "--schema", "nowhere"], "dramatiq-pg-outbox migrate"),
    ):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode in (1, 2), done.stderr
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


@pytest.fixture
def redis_user() -> Iterator[str]:
    """A Redis ACL user with a password, deleted after the test; its name."""
    if not reachable("127.0.0.1", 6379):
        pytest.skip("no redis server at 127.0.0.1:6379")
    client = redis.Redis.from_url(REDIS)
    name = f"relay_{uuid.uuid4().hex[:8]}"
    client.acl_setuser(name, enabled=True, passwords=["+right"], keys=["*"], commands=["+@all"])
    try:
        yield name
    finally:
        client.acl_deluser(name)
        client.close()


def test_a_target_the_relay_cannot_use_stops_it_at_start_with_one_line(
    database_url: str, db: Any, redis_user: str
) -> None:
    # Given targets with a refused password, a closed port or an unknown host
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    base = [sys.executable, "-m", "dramatiq_pg_outbox.cli", "relay", "--url", database_url, "--queues", "a"]
    for to, message in (
        (AMQP.replace("guest:guest@", "guest:wrong-secret@"), "refused the relay's credentials"),
        (f"redis://{redis_user}:wrong-secret@127.0.0.1:6379/0", "refused the relay's credentials"),
        (f"amqp://guest:guest@127.0.0.1:{closed}/%2F", "Check that the server runs"),
        (f"redis://127.0.0.1:{closed}/0", "connection refused"),
        ("amqp://guest:guest@no-such-host.invalid:5672/%2F", "unknown host"),
    ):
        # When the relay command starts
        done = subprocess.run([*base, "--to", to], capture_output=True, text=True, timeout=60)
        # Then it exits 1 at once with one line (the password masked), never "relaying ..."
        assert done.returncode == 1, (to, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, (to, done.stderr)
        assert "wrong-secret" not in done.stderr and "relaying" not in done.stdout
    # And the right password of the same Redis user works
    right = f"redis://{redis_user}:right@127.0.0.1:6379/0"
    from dramatiq_pg_outbox.relay import check_target, target_broker

    target = target_broker(right)
    try:
        check_target(target, right)
    finally:
        target.close()


def test_a_busy_metrics_port_is_one_line_without_alembic_chatter(database_url: str, db: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "dramatiq_pg_outbox.cli", "relay", "--url", database_url,
             "--to", AMQP, "--queues", "a", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"dramatiq-pg-outbox relay: error: cannot listen on 127.0.0.1:{port}: "
        "Address already in use. Choose another --metrics-port"
    ]


def test_a_relay_whose_credentials_are_refused_later_stops_instead_of_retrying_forever(
    db: Any, broker: PostgresBroker, redis_user: str
) -> None:
    from dramatiq.brokers.redis import RedisBroker

    from dramatiq_pg_outbox.relay import TargetUnusable

    # Given a relay to Redis as a user whose password is then changed (rotated), its connections cut
    queue = f"relay_{uuid.uuid4().hex[:10]}"
    namespace = f"dpo-relay-{uuid.uuid4().hex[:8]}"
    target = RedisBroker(url=f"redis://{redis_user}:right@127.0.0.1:6379/0", namespace=namespace)
    relay = Relay(broker, target, [queue], batch_size=10)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            relay.run()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    admin = redis.Redis.from_url(REDIS)
    try:
        send = producer_actor(broker, queue)
        send.send("first")
        wait_for(lambda: relay.stats.relayed == 1, 30, "the first message relayed")
        admin.acl_setuser(redis_user, enabled=True, reset_passwords=True, passwords=["+rotated"])
        admin.client_kill_filter(user=redis_user)
        # When the next message is published
        send.send("second")
        # Then the relay stops with the reason instead of backing off forever
        thread.join(30)
        assert not thread.is_alive(), "the relay kept retrying"
        assert len(raised) == 1 and isinstance(raised[0], TargetUnusable), raised
        assert "refused the relay's credentials" in str(raised[0]) and "right" not in str(raised[0])
        assert count(db, "SELECT count(*) FROM dramatiq.messages") == 1  # the second waits, not lost
    finally:
        relay.stop()
        thread.join(10)
        for key in admin.scan_iter(f"{namespace}*"):
            admin.delete(key)
        admin.close()
        target.close()
