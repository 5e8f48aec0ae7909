"""Run the whole transactional-email example with one command and check its result.

::

    python -m examples.transactional_email [--signups 3000]

Starts an SMTP server, creates a scratch database (on ``$DATABASE_URL``, the
local server, or a throwaway Postgres), starts ``dramatiq`` worker processes,
signs users up from several threads (some signups roll back on purpose),
waits for the queue to drain, stops the workers and prints a report.  Exit
status 0 means: one email per committed signup, none for rolled-back ones.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
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
from dramatiq_pg_outbox.devserver import mask_password, postgres_server, scratch_database  # noqa: E402
from examples._workers import dramatiq_workers  # noqa: E402
from examples.transactional_email.report import Outcomes, enqueued_user_ids, report  # noqa: E402
from examples.transactional_email.smtp_server import MailStore, SmtpServer  # noqa: E402

#: Schema of the broker's tables.
BROKER_SCHEMA = "dramatiq"
#: Module the workers load (it also builds the broker of this process).
TASKS_MODULE = "examples.transactional_email.tasks"


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


def wait_for_drain(url: str, store: MailStore, worker: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait until no message is left and the email count is stable; ``False`` on timeout."""
    deadline = time.monotonic() + timeout
    previous = -1
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise RuntimeError(f"the dramatiq workers exited early (status {worker.returncode})")
        received = store.count()
        if pending_messages(url) == 0 and received == previous:
            return True
        previous = received
        time.sleep(0.5)
    return False


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
    # Say which PostgreSQL server devserver picked ($DATABASE_URL, local, throwaway), password masked.
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")
    logging.getLogger("dramatiq_pg_outbox.devserver").setLevel(logging.INFO)
    print(
        f"transactional email: {args.signups} signups from {args.producers} threads, "
        f"{args.processes} worker processes x {args.threads} threads"
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
        stack.enter_context(local_broker())

        log_path = tmp / "workers.log"
        with dramatiq_workers(TASKS_MODULE, args.processes, args.threads, log_path) as worker:
            started = time.time()
            outcomes = run_signups(url, args.signups, args.producers)
            print(f"  signups done in {time.time() - started:.1f} s; waiting for the emails")
            drained = wait_for_drain(url, smtp.store, worker, args.timeout)
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
