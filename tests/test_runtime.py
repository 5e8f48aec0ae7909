"""A worker process's runtime: its claims in memory, its flush thread, its connections."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Any

import dramatiq
import pytest

from dramatiq_pg_outbox import PostgresBroker

from .conftest import ROOT

#: Background maintenance ticks once at start, then the test drives it by hand.
MANUAL = {"heartbeat_interval": 600_000, "heartbeat_timeout": 1_200_000, "rescue_interval": 600_000}


def test_a_stale_ack_leaves_a_newer_claim_of_the_same_row_in_memory(make_broker: Any, db: Any) -> None:
    # Given a message claimed by this process, released (as if the worker had looked dead)
    # and claimed again by this same process under a new lease
    broker = make_broker(**MANUAL)

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    task.send()
    consumer = broker.consume("default", prefetch=2, timeout=1_000)
    first = next(consumer)
    assert first is not None
    db.execute("UPDATE dramatiq.messages SET state = 'pending', lease = NULL, owner = NULL")
    consumer.notify()
    second = next(consumer)
    assert second is not None and second.row_id == first.row_id and second.lease != first.lease
    # When the first delivery's late ack is flushed (stale: fenced out by the lease)
    consumer.ack(first)
    assert broker.runtime.flusher.flush_once()["stale"] == 1
    # Then the newer claim is still known, and the orphan check leaves it alone
    assert broker.runtime.inflight == {second.row_id: second.lease}
    maintenance = broker.runtime.maintenance
    assert maintenance is not None and maintenance.ticked.wait(10)
    assert maintenance.release_orphans(grace_ms=0) == 0
    rows = db.execute("SELECT state, lease FROM dramatiq.messages").fetchall()
    assert rows == [("processing", second.lease)]
    # And its own ack completes the message
    consumer.ack(second)
    assert broker.runtime.flusher.flush_once()["acked"] == 1
    assert broker.runtime.inflight == {}
    consumer.close()


def test_closing_right_after_an_ack_stops_the_flush_thread(make_broker: Any, db: Any) -> None:
    # Given an ack that woke the flush thread, which now gathers more for flush_interval
    broker: PostgresBroker = make_broker(flush_interval=500)

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    task.send()
    consumer = broker.consume("default", prefetch=1, timeout=1_000)
    message = next(consumer)
    assert message is not None
    consumer.ack(message)
    time.sleep(0.05)  # the thread is inside its flush_interval wait
    consumer.close()
    # When the flusher is stopped meanwhile (broker.close() does this)
    flusher = broker.runtime.flusher
    flusher.stop(timeout=3)
    # Then the ack is written and the thread has ended
    assert db.execute("SELECT state FROM dramatiq.history").fetchall() == [("completed",)]
    assert flusher.started and not flusher.running


#: Run in a subprocess: opens enough files that the broker's sockets get descriptors >= 1024.
MANY_FILES_SCRIPT = textwrap.dedent(
    """
    import os, resource, sys
    import dramatiq
    from dramatiq_pg_outbox import PostgresBroker

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if wanted < 1200:
        print(f"SKIP: RLIMIT_NOFILE hard limit {hard}")
        sys.exit(0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    assert min(held[-10:]) >= 1024

    broker = PostgresBroker(url=sys.argv[1], max_fetch_interval=200)
    dramatiq.set_broker(broker)

    @dramatiq.actor(broker=broker)
    def task(x):
        pass

    task.send(42)
    consumer = broker.consume("default", prefetch=1, timeout=10_000)
    message = next(consumer)
    assert message is not None and message.args == (42,), message
    consumer.ack(message)
    assert broker.runtime.flusher.flush_once()["acked"] == 1
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else []
    consumer.close()
    broker.close()
    print("OK", max(fds) if fds else "?")
    """
)


def test_a_process_with_file_descriptors_above_1024_sends_and_consumes(database_url: str, db: Any) -> None:
    # Given a process holding 1,100 open files, so its database sockets get descriptors >= 1024
    # When it sends a message and consumes it through the broker
    done = subprocess.run(
        [sys.executable, "-c", MANY_FILES_SCRIPT, database_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout.strip())
    # Then both work (select() would raise "filedescriptor out of range in select()")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("OK"), done.stdout + done.stderr[-3000:]
    assert db.execute("SELECT state FROM dramatiq.history").fetchall() == [("completed",)]


def test_untrack_forgets_a_claim_by_the_value_of_its_lease_and_keeps_a_claim_of_another(
    make_broker: Any,
) -> None:
    import uuid

    # Given three rows claimed in memory, two under one lease and one under another
    runtime = make_broker().runtime
    first, second = uuid.uuid4(), uuid.uuid4()
    runtime.track([1, 2], first)
    runtime.track([3], second)
    # When decisions are written for all three: one with an equal copy of its lease, one with the
    # claim's own lease object, one with a stale lease
    runtime.untrack([(1, uuid.UUID(str(first))), (2, first), (3, uuid.uuid4())])
    # Then the first two are forgotten and the claim under the other lease stays
    assert runtime.inflight == {3: second}
