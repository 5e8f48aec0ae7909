"""Run the whole transactional-email example with one command and check its result.

::

    python -m examples.transactional_email [--signups 3000] [--relay rabbitmq|redis]

Starts an SMTP server, creates a scratch database (on ``$DATABASE_URL``, the
local server, or a throwaway Postgres), starts ``dramatiq`` worker processes,
signs users up from several threads (some signups roll back on purpose),
waits for the queue to drain, stops the workers and prints a report.  Exit
status 0 means: one email per committed signup, none for rolled-back ones.

With ``--relay rabbitmq`` (or ``redis``) the signups still enqueue through the
outbox into PostgreSQL, a ``dramatiq-pg-outbox relay`` process moves the
committed messages to RabbitMQ (Redis), and the workers are ordinary
``RabbitmqBroker`` (``RedisBroker``) workers.  The queue is the run's own and is
deleted at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg
from psycopg import sql

REPO_ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: python examples/transactional_email/run.py
    sys.path.insert(0, str(REPO_ROOT))

from dramatiq_pg_outbox import upgrade  # noqa: E402
from dramatiq_pg_outbox.testing import mask_password, postgres_server, scratch_database  # noqa: E402
from examples._workers import dramatiq_workers, supervised  # noqa: E402
from examples.transactional_email.report import Outcomes, enqueued_user_ids, report  # noqa: E402
from examples.transactional_email.smtp_server import MailStore, SmtpServer  # noqa: E402

#: Schema of the broker's tables.
BROKER_SCHEMA = "dramatiq"
#: Module the workers load (it also builds the broker of this process).
TASKS_MODULE = "examples.transactional_email.tasks"
#: Where ``--relay`` sends the messages (override with $EXAMPLE_RABBITMQ_URL / $EXAMPLE_REDIS_URL).
RELAY_TARGETS = {
    "rabbitmq": os.environ.get("EXAMPLE_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    "redis": os.environ.get("EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/0"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.transactional_email",
        description="Transactional enqueue end to end: signups, dramatiq workers, a real SMTP server.",
    )
    parser.add_argument("--signups", type=int, default=3000, help="number of signups (default 3000)")
    parser.add_argument("--producers", type=int, default=4, help="signup threads (default 4)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--threads", type=int, default=8, help="threads per worker process (default 8)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the emails")
    parser.add_argument(
        "--relay",
        choices=sorted(RELAY_TARGETS),
        help="relay the outbox to RabbitMQ or Redis, whose workers send the emails",
    )
    return parser.parse_args(argv)


def plan(index: int) -> tuple[str, bool]:
    """Email and ``fail`` flag of signup number ``index``.

    Every 10th signup is rejected by the application after its message was
    sent; every 50th reuses the address of signup 0 and is rejected by the
    database's unique constraint at commit.  Signup 0 itself always commits.
    """
    if index % 50 == 24:
        return "user0@example.com", False
    return f"user{index}@example.com", index % 10 == 9


def run_signups(url: str, count: int, producers: int) -> Outcomes:
    """Sign ``count`` users up from ``producers`` threads, each signup in its own transaction."""
    from sqlalchemy.orm import Session

    from examples.transactional_email.app import SignupFailed, sign_up
    from examples.transactional_email.models import engine_for

    engine = engine_for(url, pool_size=producers)
    outcomes = Outcomes()

    def one(index: int) -> None:
        email, fail = plan(index)
        with Session(engine) as session:
            try:
                user_id = sign_up(session, email, fail=fail)
            except SignupFailed as exc:
                with outcomes.lock:
                    outcomes.reasons[exc.reason] += 1
                    if exc.user_id is not None:
                        outcomes.rolled_back.add(exc.user_id)
                return
        with outcomes.lock:
            outcomes.committed.add(user_id)

    try:
        one(0)  # the address the duplicates collide with is committed first
        with ThreadPoolExecutor(max_workers=producers) as pool:
            for future in [pool.submit(one, index) for index in range(1, count)]:
                future.result()
    finally:
        engine.dispose()
    return outcomes


def pending_messages(url: str) -> int:
    """Rows left in the broker's messages table (waiting, delayed or being processed)."""
    query = sql.SQL("SELECT count(*) FROM {}.messages").format(sql.Identifier(BROKER_SCHEMA))
    with psycopg.connect(url) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def wait_for_drain(
    url: str,
    store: MailStore,
    processes: list[subprocess.Popen[bytes]],
    timeout: float,
    expected: int,
    settle: float = 0.5,
) -> bool:
    """Wait until no message is left in PostgreSQL and either ``expected`` emails arrived or the
    email count stayed the same for ``settle`` seconds; ``False`` on timeout."""
    deadline = time.monotonic() + timeout
    previous, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[3]!r} exited early (status {process.returncode})")
        received = store.count()
        if received != previous:
            previous, since = received, time.monotonic()
        if pending_messages(url) == 0 and (received >= expected or time.monotonic() - since >= settle):
            return True
        time.sleep(0.1)
    return False


@contextmanager
def relay_process(url: str, target: str, queue: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``dramatiq-pg-outbox relay`` of ``queue`` to ``target``, stopped with SIGTERM at exit."""
    command = [
        sys.executable, "-m", "dramatiq_pg_outbox.cli", "relay",
        "--url", url, "--to", target, "--queues", queue, "--report-every", "5",
    ]  # fmt: skip
    with supervised(command, log_path) as process:
        yield process


def delete_target_queue(target: str, queue: str) -> None:
    """Remove the run's queue (and its delay and dead-letter queues) from RabbitMQ or Redis."""
    if target.startswith("amqp"):
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(target))
        try:
            channel = connection.channel()
            for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                channel.queue_delete(name)
        finally:
            connection.close()
    else:
        import redis

        client = redis.Redis.from_url(target)
        try:
            keys = [
                k for name in (queue, f"{queue}.DQ", f"{queue}.XQ") for k in client.scan_iter(f"*{name}*")
            ]
            if keys:
                client.delete(*keys)
        finally:
            client.close()


def prepare_database(url: str) -> None:
    """Create the broker's tables (the package's migrations) and the application's."""
    from examples.transactional_email.models import create_tables, engine_for

    upgrade(url, schema=BROKER_SCHEMA)
    engine = engine_for(url)
    try:
        create_tables(engine)
    finally:
        engine.dispose()


@contextmanager
def local_broker() -> Iterator[None]:
    """Close this process's broker at exit (``tasks`` builds it on import), before the database goes."""
    try:
        yield
    finally:
        tasks = sys.modules.get(TASKS_MODULE)
        if tasks is not None:
            tasks.broker.close()


def main(argv: list[str] | None = None) -> int:
    """Run the example; return the exit status."""
    args = parse_args(argv)
    # Say which PostgreSQL server was picked ($DATABASE_URL, local, throwaway), password masked.
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")
    logging.getLogger("dramatiq_pg_outbox.testing").setLevel(logging.INFO)
    target = RELAY_TARGETS[args.relay] if args.relay else None
    print(
        f"transactional email: {args.signups} signups from {args.producers} threads, "
        f"{args.processes} worker processes x {args.threads} threads"
        + (f", relayed to {args.relay}" if args.relay else "")
    )
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="transactional_email_")))
        url = stack.enter_context(
            scratch_database(stack.enter_context(postgres_server()), "transactional_email")
        )
        print(f"  database   {mask_password(url)} (dropped at exit)")
        prepare_database(url)
        smtp = stack.enter_context(SmtpServer(tmp / "mailbox.sqlite3"))
        print(f"  smtp       {smtp.host}:{smtp.port} (aiosmtpd, stores into {smtp.store.path.name})")
        # Read by tasks.py, in this process and in the workers (which inherit the environment).
        os.environ["EXAMPLE_DATABASE_URL"] = url
        os.environ["EXAMPLE_SMTP_HOST"] = smtp.host
        os.environ["EXAMPLE_SMTP_PORT"] = str(smtp.port)
        worker_env: dict[str, str] = {}
        if target is not None:
            queue = f"welcome_{uuid.uuid4().hex[:8]}"
            os.environ["EXAMPLE_QUEUE"] = queue
            worker_env["EXAMPLE_CONSUME_FROM"] = target  # the workers only: this process writes the outbox
            stack.callback(delete_target_queue, target, queue)
            relay = stack.enter_context(relay_process(url, target, queue, tmp / "relay.log"))
            print(
                f"  relay      {queue} -> {mask_password(target)} (dramatiq-pg-outbox relay, pid {relay.pid})"
            )
        stack.enter_context(local_broker())

        log_path = tmp / "workers.log"
        with dramatiq_workers(TASKS_MODULE, args.processes, args.threads, log_path, worker_env) as worker:
            started = time.time()
            outcomes = run_signups(url, args.signups, args.producers)
            print(f"  signups done in {time.time() - started:.1f} s; waiting for the emails")
            watched = [worker] if target is None else [worker, relay]
            drained = wait_for_drain(
                url, smtp.store, watched, args.timeout, len(outcomes.committed), 0.5 if target is None else 5
            )
        last_email = smtp.store.last_received_at() or time.time()
        enqueued = enqueued_user_ids(url, BROKER_SCHEMA, "send_welcome_email")
        print()
        problems = report(outcomes, smtp.store.user_ids(), enqueued, last_email - started)
        if not drained:
            problems.insert(0, f"messages still queued after {args.timeout:.0f} s")
        if problems:
            print("\nFAILED: " + "\n        ".join(problems))
            print(f"\nlast lines of the workers' log ({log_path.name}):")
            print("\n".join(log_path.read_text(errors="replace").splitlines()[-30:]))
            return 1
    print("\nOK: every committed signup got exactly one email, no rolled-back signup got any.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
