"""Real processes: a worker started by ``manage.py rundramatiq``; a web process killed after its COMMIT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shop.models import Order

from .helpers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

#: The example project's folder (manage.py).
PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rundramatiq() -> Iterator[subprocess.Popen[bytes]]:
    """``python manage.py rundramatiq`` on the test databases (the settings read them from the env)."""
    command = [sys.executable, "manage.py", "rundramatiq", "--processes", "1", "--threads", "2"]
    command += ["--worker-shutdown-timeout", "5000"]
    proc = subprocess.Popen(command, cwd=PROJECT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # rundramatiq exec'd dramatiq: it stops its workers
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def test_a_rundramatiq_worker_sends_the_receipt_of_an_order_placed_in_the_view(
    rundramatiq: subprocess.Popen[bytes], client: Any
) -> None:
    # Given a worker started by django_dramatiq's command
    # When an order is placed through the view (atomic() and outbox())
    response = client.post("/orders/", {"email": "ada@example.com", "total_cents": "1250"})
    assert response.status_code == 201
    order_id = response.json()["order"]
    # Then the worker runs send_receipt for it
    wait_for(lambda: Order.objects.get(pk=order_id).receipt_sent_at is not None, 60, "the receipt")
    assert rundramatiq.poll() is None
    # (Not checked: django_dramatiq's Task row ends "done". Its AdminMiddleware writes "enqueued"
    # in after_enqueue, after the COMMIT, and the worker may have run the message by then, with
    # this broker as with Redis or RabbitMQ.)


@pytest.mark.parametrize(("how", "messages"), [("outbox", 1), ("on_commit", 0)])
def test_a_web_process_killed_right_after_its_commit_keeps_the_message_only_with_the_outbox(
    how: str, messages: int, sql: Any
) -> None:
    # Given a process that placed an order and hangs right after the COMMIT
    child = subprocess.Popen(
        [sys.executable, "-m", "shop.tests.place_order_then_hang", how],
        cwd=PROJECT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        said = child.stdout.readline()
    finally:
        # When it is killed there
        os.killpg(child.pid, signal.SIGKILL)
        _, errors = child.communicate(timeout=30)
    assert said == "committed\n", errors
    # Then its order is committed in both cases; its receipt message only with the outbox
    # (transaction.on_commit had not sent it yet: that message is lost)
    assert Order.objects.count() == 1
    assert sql("default", "SELECT count(*) FROM dramatiq.messages") == [(messages,)]
