"""Where the time of one ``send()`` inside a Session transaction goes (issue 37, part 4).

``python -m benchmarks.profile_outbox_send [--pg-url URL] [--txns N]`` (by default on a private
durable server, with ``synchronous_commit=off`` on its database so that the COMMIT's disk flush
does not hide the rest). Prints, as CPU microseconds per transaction (``time.process_time``,
medians of 3 interleaved rounds):

1. the outbox's hooks in a Session transaction with one send (``notify="off"``): the send alone
   (buffered, then rolled back), ``before_commit``, the write that rides with the COMMIT, and
   ``after_commit``, against the bare transaction;
2. plain psycopg (no SQLAlchemy): an INSERT + COMMIT, then the same with the messages'
   ``enqueue_one`` as a separate statement, and with it in a pipeline with the COMMIT;
3. the server's execution time of ``enqueue_one`` (``EXPLAIN ANALYZE``, median of 40, rolled
   back) against the business row's INSERT, and with the ring's slot as a literal instead of
   ``message_slot()``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

from .bench_common import OURS, Context, db_name, postgres_for_benchmarks
from .bench_outbox_send import Order, _install, _setup


def _cpu_us(cases: dict[str, Callable[[int], None]], n: int, rounds: int = 3) -> dict[str, float]:
    for body in cases.values():
        body(50)
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, body in cases.items():
            c0 = time.process_time()
            body(n)
            out[name].append((time.process_time() - c0) * 1e6 / n)
    return {name: statistics.median(v) for name, v in out.items()}


def hooks_part(url: str, n: int) -> None:
    import dramatiq
    from sqlalchemy.orm import Session

    from dramatiq_pg_outbox import PostgresBroker, outbox
    from dramatiq_pg_outbox.outbox import hooks

    spent: dict[str, float] = {}

    def timed(name: str) -> None:
        inner = getattr(hooks, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            c0 = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.process_time() - c0

        setattr(hooks, name, wrapper)

    # Before the first outbox(): the session listeners are installed with the wrappers.
    for name in ("_session_before_commit", "write_with_commit", "_session_after_commit"):
        timed(name)
    engine, cases, close = _setup(url)
    broker = PostgresBroker(url=url, notify="off")
    actor = dramatiq.actor(lambda i: None, broker=broker, actor_name="profiled")

    def send_then_rollback(k: int) -> None:
        for i in range(k):
            with Session(engine) as session, outbox(session, broker):
                session.add(Order(customer="c", amount=i))
                actor.send(i)
                session.rollback()

    def no_send_rollback(k: int) -> None:
        for i in range(k):
            with Session(engine) as session, outbox(session, broker):
                session.add(Order(customer="c", amount=i))
                session.rollback()

    def one_send(k: int) -> None:
        for i in range(k):
            with Session(engine) as session:
                with outbox(session, broker):
                    session.add(Order(customer="c", amount=i))
                    actor.send(i)
                session.commit()

    bare = cases["bare Session transaction"]
    measured = {"bare": bare, "one send": one_send, "send, rollback": send_then_rollback}
    measured["no send, rollback"] = no_send_rollback
    spent.clear()
    one_send(50)
    spent.clear()
    one_send(n)
    per_txn = {name: v * 1e6 / n for name, v in spent.items()}
    cpu = _cpu_us(measured, n)
    print("\n1. Session transaction, CPU us per transaction (notify='off'):")
    print(f"   bare transaction: {cpu['bare']:.0f}; with one send: {cpu['one send']:.0f}")
    print(f"   the send alone: {cpu['send, rollback'] - cpu['no send, rollback']:.0f}")
    for name, v in per_txn.items():
        print(f"   {name}: {v:.0f}")
    broker.close()
    close()


def psycopg_part(url: str, n: int) -> None:
    from dramatiq import Message

    from dramatiq_pg_outbox._runtime import StoredMessage, enqueue_statement
    from dramatiq_pg_outbox.store.messages import message_store

    store = message_store("dramatiq")
    conn = psycopg.connect(url)
    business = "INSERT INTO bench_orders (customer, amount) VALUES ('c', 1)"

    def statement() -> Any:
        m = Message(queue_name="default", actor_name="profiled", args=(1,), kwargs={}, options={})
        return enqueue_statement([StoredMessage.of(m)], "dramatiq", False, 1000)

    def bare(k: int) -> None:
        for _ in range(k):
            conn.execute(business)
            conn.commit()

    def separate(k: int) -> None:
        for _ in range(k):
            conn.execute(business)
            store.enqueue(conn.cursor(), statement())
            conn.commit()

    def pipelined(k: int) -> None:
        for _ in range(k):
            conn.execute(business)
            cursor, commit_cursor = conn.cursor(), conn.cursor()
            with conn.pipeline():
                store.enqueue_send(cursor, statement())
                store.commit_send(commit_cursor)
            store.enqueue_rows(cursor)

    cpu = _cpu_us({"bare": bare, "separate": separate, "pipelined": pipelined}, n)
    print("\n2. plain psycopg, CPU us per transaction:")
    print(f"   INSERT + COMMIT: {cpu['bare']:.0f}")
    print(f"   + enqueue_one as its own statement: +{cpu['separate'] - cpu['bare']:.0f}")
    print(f"   + enqueue_one in a pipeline with the COMMIT: +{cpu['pipelined'] - cpu['bare']:.0f}")

    slot = conn.execute("SELECT slot FROM dramatiq.message_ring").fetchone()[0]  # type: ignore[index]
    conn.rollback()
    query = store.queries["enqueue_one"]
    variants = {
        "enqueue_one": query,
        "enqueue_one, the slot as a literal": query.replace('"dramatiq".message_slot()', f"{slot}::smallint"),
        "the business row's INSERT": business,
    }
    print("\n3. server execution, ms (EXPLAIN ANALYZE, median of 40):")
    for name, text in variants.items():
        times = []
        for _ in range(40):
            params = statement().params if "%(" in text else None
            plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + text, params).fetchone()[0]  # type: ignore[index]
            times.append(plan[0]["Execution Time"])
            conn.rollback()
        print(f"   {name}: {statistics.median(times):.3f}")
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_outbox_send", description=__doc__)
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL"), help="admin URL of a server")
    parser.add_argument("--txns", type=int, default=3_000, help="transactions per case and round")
    args = parser.parse_args()
    with postgres_for_benchmarks(args.pg_url) as admin_url:
        url = Context(admin_url, 1, False, (OURS,), "").db_url(db_name(OURS, "outbox_send"))
        _install(admin_url, url, "off")
        print(f"# load {os.getloadavg()[0]:.1f}", flush=True)
        hooks_part(url, args.txns)
        psycopg_part(url, args.txns)
        print(f"# load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
