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
   ``message_slot()``;
4. with ``--pgbench``: the server's cost as a C client sees it, ``pgbench -M prepared``, one
   client, wall microseconds per transaction (medians of interleaved 4-second runs): the
   business row alone, with a second business row, then with ``enqueue_one`` in the same
   transaction (its parameters bound as a send binds them), and with the ``enqueue_one`` of
   another tree's ``queries.sql`` (``--compare-queries PATH``: a before/after of the statement
   on one server).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psycopg

from .bench_common import OURS, Context, db_name, postgres_for_benchmarks
from .bench_outbox_send import BUSINESS_TABLE, Order, _install, _setup


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


def _pgbench_script(statement: str) -> str:
    """A pgbench transaction: the business row, then ``statement`` (``%(name)s`` as ``:name``)."""
    body = re.sub(r"^--.*$", "", statement, flags=re.M).strip().rstrip(";")
    body = re.sub(r"%\((\w+)\)s", r":\1", body)
    return (
        "BEGIN;\nINSERT INTO bench_orders (customer, amount) VALUES ('c', 1);\n"
        + (body + ";\n" if body else "")
        + "COMMIT;\n"
    )


def pgbench_part(url: str, compare: str | None, rounds: int, seconds: int) -> None:
    """Part 4: wall us per transaction under ``pgbench -M prepared`` (one client)."""
    from dramatiq import Message

    from dramatiq_pg_outbox._queries import STATEMENT_HEADER
    from dramatiq_pg_outbox._runtime import StoredMessage, enqueue_statement
    from dramatiq_pg_outbox.store.messages import message_store

    if shutil.which("pgbench") is None:
        print("\n4. pgbench: not installed, skipped")
        return
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(BUSINESS_TABLE)
    query = message_store("dramatiq").queries["enqueue_one"]
    variants = {
        "the business row alone": "",
        "+ a second business row": "INSERT INTO bench_orders (customer, amount) VALUES ('c', 2)",
        "+ enqueue_one": query,
    }
    if compare:
        with open(compare) as f:
            parts = STATEMENT_HEADER.split(f.read())
        bodies = {name: body for name, body in zip(parts[2::3], parts[3::3], strict=True)}
        variants[f"+ enqueue_one of {compare}"] = bodies["enqueue_one"].replace("{schema}", '"dramatiq"')
    m = Message(queue_name="default", actor_name="profiled", args=(1,), kwargs={}, options={})
    params = enqueue_statement([StoredMessage.of(m)], "dramatiq", True, 1000).params
    defines = []
    for key, value in params.items():
        text = "\\x" + value.hex() if isinstance(value, bytes) else str(value).lower()
        defines += ["-D", f"{key}={text}"]
    walls: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds + 1):
            for name, statement in variants.items():
                script = os.path.join(d, "t.sql")
                with open(script, "w") as f:
                    f.write(_pgbench_script(statement))
                command = ["pgbench", "-n", "-M", "prepared", "-c", "1", "-T", str(seconds), *defines]
                done = subprocess.run([*command, "-f", script, url], capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"pgbench failed: {done.stderr.strip()[-500:]}")
                out = done.stdout
                tps = float(re.search(r"tps = ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
                if r:  # the first round warms the tables and the caches up
                    walls[name].append(1e6 / tps)
    print(f"\n4. pgbench -M prepared, one client, wall us per transaction (median, min-max of {rounds}):")
    for name, w in walls.items():
        print(f"   {name}: {statistics.median(w):.0f} ({min(w):.0f}-{max(w):.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_outbox_send", description=__doc__)
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL"), help="admin URL of a server")
    parser.add_argument("--txns", type=int, default=3_000, help="transactions per case and round")
    parser.add_argument("--pgbench", action="store_true", help="part 4 only: the statement under pgbench")
    parser.add_argument("--compare-queries", help="part 4: also the enqueue_one of this queries.sql")
    parser.add_argument("--rounds", type=int, default=5, help="part 4: interleaved rounds")
    args = parser.parse_args()
    with postgres_for_benchmarks(args.pg_url) as admin_url:
        url = Context(admin_url, 1, False, (OURS,), "").db_url(db_name(OURS, "outbox_send"))
        _install(admin_url, url, "off")
        print(f"# load {os.getloadavg()[0]:.1f}", flush=True)
        if args.pgbench:
            pgbench_part(url, args.compare_queries, args.rounds, 4)
        else:
            hooks_part(url, args.txns)
            psycopg_part(url, args.txns)
        print(f"# load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
