"""Scenario 9 (relay): the outbox relay to RabbitMQ against publishing to RabbitMQ after commit.

Both producers write a business row in a SQLAlchemy ``Session`` transaction, one
transaction per message, from one thread:

* **relay**: the message goes into the outbox in the same transaction
  (``with outbox(session): actor.send(i)``; ``session.commit()``); a relay process
  (``dramatiq_pg_outbox.relay.Relay``, batches of 500, LISTEN on) moves committed
  messages to RabbitMQ, one AMQP transaction per batch.
* **direct**: ``session.commit()``, then ``RabbitmqBroker.enqueue()`` with publisher
  confirms (``confirm_delivery=True``): what an application does without an outbox
  (and what loses the message if the process dies between the two).

Part 1, throughput (no consumer): N messages.  "commit to confirm" is the time
from the first commit to the moment RabbitMQ confirmed the last message (for
the relay: its last batch archived); "producer" is the producer loop's own rate.
"Backlog drain" is the relay alone, on N messages committed before it starts.

Part 2, added latency: K messages ``SPACING_MS`` apart, consumed by one
``dramatiq`` worker process of ``RabbitmqBroker`` (8 threads, idle); latency is
actor start minus the return of ``session.commit()`` (``time.time()``, one machine).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any

import psycopg

from .bench_common import OURS, RABBITMQ, RABBITMQ_URL, Context, markdown_table, percentile, reachable
from .bench_systems import ACTOR, QUEUE, WorkerGroup, install, make_broker

#: Pause between two sends of part 2, in milliseconds.
SPACING_MS = 20
#: Messages per relay claim.
BATCH_SIZE = 500


def _relay_process(url: str, ready: Any, stop: Any) -> None:
    """A relay of QUEUE to RabbitMQ until ``stop`` (spawned: its own interpreter and GIL)."""
    import threading

    from dramatiq_pg_outbox import PostgresBroker
    from dramatiq_pg_outbox.relay import Relay, target_broker

    logging.basicConfig(level=logging.WARNING)
    broker = PostgresBroker(url=url)
    target = target_broker(RABBITMQ_URL)
    relay = Relay(broker, target, [QUEUE], batch_size=BATCH_SIZE)
    threading.Thread(target=lambda: (stop.wait(), relay.stop()), daemon=True).start()
    ready.set()
    try:
        relay.run()
    finally:
        broker.close()
        target.close()


class RelayProcess:
    """:func:`_relay_process` in a spawned process, started and ready."""

    def __init__(self, url: str) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.stop = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_relay_process, args=(url, self.ready, self.stop), daemon=True)

    def __enter__(self) -> RelayProcess:
        self.proc.start()
        if not self.ready.wait(60):
            raise RuntimeError("the relay process did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def _prepare(ctx: Context) -> str:
    dbname = "bench_relay"
    url = ctx.db_url(dbname)
    install(OURS, ctx.admin_url, dbname, url)
    install(RABBITMQ, ctx.admin_url, dbname, url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, n int NOT NULL)")
    return url


def _archived(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM dramatiq.history").fetchone()
    return int(row[0]) if row else 0


class Producer:
    """One thread's transactions: a business row, and the message by the chosen route."""

    def __init__(self, url: str, route: str) -> None:
        import dramatiq
        from sqlalchemy import create_engine

        self.route = route
        self.engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        self.broker = make_broker(RABBITMQ if route == "direct" else OURS, url, {})
        if route == "direct":
            self.broker.confirm_delivery = True
        self.actor = dramatiq.actor(lambda i: None, broker=self.broker, actor_name=ACTOR, queue_name=QUEUE)
        with self.engine.connect():  # connect outside the measurement
            pass

    def send(self, i: int) -> float:
        """Commit order ``i`` with its message; ``time.time()`` when the commit returned."""
        from sqlalchemy import text
        from sqlalchemy.orm import Session

        from dramatiq_pg_outbox import outbox

        with Session(self.engine) as session:
            session.execute(text("INSERT INTO orders (n) VALUES (:n)"), {"n": i})
            if self.route == "relay":
                with outbox(session, self.broker):
                    self.actor.send(i)
                session.commit()
                return time.time()
            session.commit()
            committed = time.time()
        self.actor.send(i)  # after the commit: lost if this process dies here
        return committed

    def close(self) -> None:
        self.broker.close()
        self.engine.dispose()


def throughput_once(ctx: Context, route: str, n: int) -> dict[str, float]:
    url = _prepare(ctx)
    producer = Producer(url, route)
    try:
        if route == "backlog":
            producer.broker.enqueue_many([producer.actor.message(i) for i in range(n)])
            with RelayProcess(url):
                started = time.perf_counter()
                while _archived(url) < n:
                    if time.perf_counter() - started > 300:
                        raise RuntimeError("the relay did not drain the backlog in 300 s")
                    time.sleep(0.005)
                return {"end_to_end": n / (time.perf_counter() - started)}
        relay = RelayProcess(url) if route == "relay" else None
        try:
            if relay is not None:
                relay.__enter__()
            started = time.perf_counter()
            for i in range(n):
                producer.send(i)
            produced = time.perf_counter()
            while route == "relay" and _archived(url) < n:
                if time.perf_counter() - started > 300:
                    raise RuntimeError("the relay did not catch up in 300 s")
                time.sleep(0.005)
            done = time.perf_counter()
        finally:
            if relay is not None:
                relay.__exit__()
        return {"end_to_end": n / (done - started), "producer": n / (produced - started)}
    finally:
        producer.close()


def latency_once(ctx: Context, route: str, k: int) -> list[float]:
    url = _prepare(ctx)
    group = WorkerGroup(RABBITMQ, url, processes=1, threads=8, slots=k)
    producer = Producer(url, route)
    relay = RelayProcess(url) if route == "relay" else None
    try:
        group.start()
        group.go()
        if relay is not None:
            relay.__enter__()
        time.sleep(1.5)  # the worker (and the relay) are up and idle
        committed = []
        for i in range(k):
            committed.append(producer.send(i))
            time.sleep(SPACING_MS / 1000)
        if group.wait_for(k, 60.0) is None:
            raise RuntimeError(f"only {group.done} of {k} messages ran within 60 s")
        started = list(group.shared.started)
        return [(started[i] - committed[i]) * 1000 for i in range(k)]
    finally:
        if relay is not None:
            relay.__exit__()
        producer.close()
        group.close()


def run(ctx: Context) -> dict[str, Any]:
    if not reachable(RABBITMQ_URL, 5672):
        return {"skipped": f"no RabbitMQ at {RABBITMQ_URL.rsplit('@', 1)[-1]} (BENCH_RABBITMQ_URL)"}
    n = 100 if ctx.smoke else 5_000 if ctx.quick else 20_000
    k = 10 if ctx.smoke else 100 if ctx.quick else 200
    rates: dict[str, dict[str, list[float]]] = {}
    latencies: dict[str, list[float]] = {}
    for run_no in range(ctx.runs):
        for route in ("direct", "relay", "backlog"):
            result = throughput_once(ctx, route, n)
            for key, value in result.items():
                rates.setdefault(route, {}).setdefault(key, []).append(value)
            shown = ", ".join(f"{key} {value:,.0f}/s" for key, value in result.items())
            print(f"  relay run {run_no + 1} throughput {route}: {shown}", flush=True)
        for route in ("direct", "relay"):
            lat = latency_once(ctx, route, k)
            latencies.setdefault(route, []).extend(lat)
            print(
                f"  relay run {run_no + 1} latency {route}: p50 {percentile(lat, 50):.2f} ms "
                f"p99 {percentile(lat, 99):.2f} ms",
                flush=True,
            )

    def median(route: str, key: str) -> float | None:
        values = sorted(rates.get(route, {}).get(key, []))
        return values[len(values) // 2] if values else None

    def rate(route: str, key: str) -> str:
        value = median(route, key)
        return "-" if value is None else f"{value:,.0f}"

    direct_e2e = median("direct", "end_to_end")
    rows = []
    for label, route in (
        ("commit, then RabbitmqBroker.enqueue (confirm)", "direct"),
        ("outbox in the transaction + relay", "relay"),
        ("relay alone, backlog drain", "backlog"),
    ):
        e2e = median(route, "end_to_end")
        ratio = f"{e2e / direct_e2e:.2f}x" if e2e and direct_e2e else "-"
        rows.append([label, rate(route, "end_to_end"), ratio, rate(route, "producer")])
    table = markdown_table(
        ["route (1 producer thread)", "commit to confirm msgs/s", "vs direct", "producer commits/s"], rows
    )
    lat_rows = []
    for label, route in (("commit, then enqueue", "direct"), ("outbox + relay", "relay")):
        lat = latencies.get(route, [])
        lat_rows.append(
            [label, str(len(lat))] + [f"{percentile(lat, p):.2f}" if lat else "-" for p in (50, 95, 99)]
        )
    latency_table = markdown_table(["route", "samples", "p50 ms", "p95 ms", "p99 ms"], lat_rows)
    return {
        "messages": n,
        "k_per_run": k,
        "throughput_table": table,
        "latency_table": latency_table,
        "raw": {
            "rates": rates,
            "latency_percentiles": {
                route: {p: percentile(v, p) for p in (50, 95, 99)} for route, v in latencies.items()
            },
        },
    }
