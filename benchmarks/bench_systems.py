"""One adapter per measured system: storage setup, bulk prefill, broker, worker process.

Dramatiq brokers (ours, StubBroker, RedisBroker, RabbitmqBroker, dramatiq-pg,
dramatiq-postgres) run a no-op actor under Dramatiq's own ``Worker``;
pgqueuer runs its own asyncio ``QueueManager``.  Worker processes are started
with the ``spawn`` method, build their broker after the start (no connection
crosses a fork) and report completions through shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import psycopg

from .bench_common import (
    DRAMATIQ_PG,
    DRAMATIQ_POSTGRES,
    OURS,
    PGQUEUER,
    PGQUEUER_B100,
    POSTGRES_SYSTEMS,
    RABBITMQ,
    RABBITMQ_URL,
    REDIS,
    REDIS_URL,
    STUB,
    recreate_database,
)

#: The queue every scenario uses (Redis and RabbitMQ are shared servers: keep it specific).
QUEUE = "dpo_bench"
#: Actor name of the no-op actor.
ACTOR = "dpo_bench_noop"
#: Rows per statement when prefilling a Postgres table.
PREFILL_BATCH = 5_000


def install(system: str, admin_url: str, dbname: str, url: str) -> None:
    """Fresh storage for one system: a new database with its schema, or an emptied queue."""
    if system in POSTGRES_SYSTEMS:
        recreate_database(admin_url, dbname)
    if system == OURS:
        from dramatiq_pg_outbox import upgrade

        upgrade(url, schema="dramatiq")
    elif system == DRAMATIQ_PG:
        from dramatiq_pg.schema import generate_init_sql

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(generate_init_sql("dramatiq", ""))  # type: ignore[arg-type]
    elif system == DRAMATIQ_POSTGRES:
        from dramatiq_postgres.schema import init

        with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
            init(cur, "dramatiq", "")
    elif system.startswith(PGQUEUER):

        async def _install() -> None:
            from pgqueuer import PsycopgDriver, Queries

            conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
            try:
                await Queries(PsycopgDriver(conn)).install()
            finally:
                await conn.close()

        asyncio.run(_install())
    elif system in (REDIS, RABBITMQ):
        broker = make_broker(system, url, {})
        broker.declare_queue(QUEUE)
        broker.flush_all()
        broker.close()


def make_broker(system: str, url: str, opts: dict[str, Any]) -> Any:
    """A Dramatiq broker for ``system`` (connections are opened lazily or at first use)."""
    if system == OURS:
        from dramatiq_pg_outbox import PostgresBroker

        return PostgresBroker(url=url, **opts)
    if system == STUB:
        from dramatiq.brokers.stub import StubBroker

        return StubBroker()
    if system == REDIS:
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=REDIS_URL, namespace="dpo-bench")
    if system == RABBITMQ:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=RABBITMQ_URL)
    if system == DRAMATIQ_PG:
        from dramatiq_pg import PostgresBroker as DramatiqPgBroker

        return DramatiqPgBroker(url=url, results=False)
    if system == DRAMATIQ_POSTGRES:
        from dramatiq_postgres import PostgresBroker as DramatiqPostgresBroker

        return DramatiqPostgresBroker(url=url, results=False)
    raise ValueError(f"{system} is not a Dramatiq broker")


def make_message(i: int, queue: str = QUEUE) -> Any:
    from dramatiq import Message

    return Message(queue_name=queue, actor_name=ACTOR, args=(i,), kwargs={}, options={})


def prefill(system: str, url: str, n: int, *, start: int = 0, broker: Any = None) -> None:
    """Queue ``n`` messages (args ``start..start+n-1``) the fastest way each system allows.

    Postgres systems get multi-row inserts into their own table format; Redis and
    RabbitMQ go through ``broker.enqueue`` (they have no bulk path in Dramatiq).
    """
    if system == OURS:
        from dramatiq_pg_outbox import PostgresBroker
        from dramatiq_pg_outbox._runtime import StoredMessage

        own = PostgresBroker(url=url)
        try:
            for lo in range(start, start + n, PREFILL_BATCH):
                hi = min(start + n, lo + PREFILL_BATCH)
                own.runtime.enqueue([StoredMessage.of(make_message(i)) for i in range(lo, hi)], notify=False)
        finally:
            own.close()
    elif system in (DRAMATIQ_PG, DRAMATIQ_POSTGRES):
        # Their own enqueue is one statement per message (~1-2k/s); write their rows directly.
        with psycopg.connect(url, autocommit=True) as conn:
            for lo in range(start, start + n, PREFILL_BATCH):
                hi = min(start + n, lo + PREFILL_BATCH)
                msgs = [make_message(i) for i in range(lo, hi)]
                conn.execute(
                    "INSERT INTO dramatiq.queue (queue_name, message_id, state, message) "
                    "SELECT %s, m, 'queued', j FROM unnest(%s::uuid[], %s::jsonb[]) AS t(m, j)",
                    (QUEUE, [m.message_id for m in msgs], [json.dumps(json.loads(m.encode())) for m in msgs]),
                )
    elif system.startswith(PGQUEUER):

        async def _fill() -> None:
            from pgqueuer import PsycopgDriver, Queries

            conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
            try:
                queries = Queries(PsycopgDriver(conn))
                for lo in range(start, start + n, PREFILL_BATCH):
                    hi = min(start + n, lo + PREFILL_BATCH)
                    await queries.enqueue(
                        [ACTOR] * (hi - lo), [str(i).encode() for i in range(lo, hi)], [0] * (hi - lo)
                    )
            finally:
                await conn.close()

        asyncio.run(_fill())
    else:
        own = broker if broker is not None else make_broker(system, url, {})
        own.declare_queue(QUEUE)
        for i in range(start, start + n):
            own.enqueue(make_message(i))
        if broker is None:
            own.close()


# -- worker processes ---------------------------------------------------------------------------


#: Threads, over all of a run's worker processes, that can count actor runs (one slot each).
COUNTING_THREADS = 1024


class Shared:
    """Shared-memory channel between the parent and its worker processes."""

    def __init__(self, ctx: Any, slots: int) -> None:
        #: Actor runs, one slot per thread that runs actors: each slot has one writer, so a run
        #: is counted without a lock. (One count under the Value's process-shared lock made the
        #: 16 threads of a 2 x 8 drain queue on one semaphore, held while its holder waited for
        #: its own process's GIL; a one-threaded asyncio worker such as pgqueuer's never did.)
        self.counts = ctx.Array("q", COUNTING_THREADS, lock=False)
        #: The next free slot of ``counts`` (taken once per thread, under this Value's lock).
        self.next_slot = ctx.Value("i", 0)
        #: Actor start time (time.time()) per message index, for latency runs.
        self.started = ctx.Array("d", max(slots, 1), lock=False)
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()
        self.stop = ctx.Event()

    @property
    def done(self) -> int:
        """Actor runs counted so far, over every worker process (the slots taken so far)."""
        return sum(self.counts[: self.next_slot.value])


#: This thread's slot (``slot``) in the ``counts`` of one ``Shared`` (``shared``): a thread that
#: counts for another channel takes a slot of that one (worker processes are spawned: no slot
#: crosses a fork).
_counting = threading.local()


def record_start(shared: Shared, i: int) -> None:
    """Note the start time of message ``i`` (if the run tracks it) and count one actor run."""
    if 0 <= i < len(shared.started):
        shared.started[i] = time.time()
    if getattr(_counting, "shared", None) is not shared:
        with shared.next_slot.get_lock():
            _counting.shared, _counting.slot = shared, shared.next_slot.value
            shared.next_slot.value += 1
    shared.counts[_counting.slot] += 1


def worker_process(
    system: str, url: str, threads: int, shared: Shared, opts: dict[str, Any], stub_prefill: int
) -> None:
    """Body of one worker process: build the broker, wait for go, consume until stop."""
    logging.basicConfig(level=logging.WARNING)
    if system.startswith(PGQUEUER):
        opts = {"batch_size": 100 if system == PGQUEUER_B100 else 10, **opts}
        asyncio.run(_pgqueuer_worker(url, shared, opts))
        return
    import dramatiq
    from dramatiq import Worker

    broker = make_broker(system, url, opts)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=QUEUE, actor_name=ACTOR, max_retries=0)
    def noop(i: int) -> None:
        record_start(shared, i)

    broker.declare_queue(QUEUE)
    if stub_prefill:
        prefill(system, url, stub_prefill, broker=broker)
    worker = Worker(broker, worker_threads=threads, worker_timeout=100)
    shared.ready.release()
    shared.go.wait()
    worker.start()
    shared.stop.wait()
    worker.stop()
    broker.close()


async def _pgqueuer_worker(url: str, shared: Shared, opts: dict[str, Any]) -> None:
    from pgqueuer import PsycopgDriver, Queries, QueueManager
    from pgqueuer.models import Job

    if opts.get("driver", "asyncpg") == "asyncpg":
        import asyncpg
        from pgqueuer import AsyncpgDriver

        conn: Any = await asyncpg.connect(url)
        driver: Any = AsyncpgDriver(conn)
    else:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        driver = PsycopgDriver(conn)
    qm = QueueManager(Queries(driver))

    @qm.entrypoint(ACTOR)
    async def noop(job: Job) -> None:
        record_start(shared, int(job.payload or b"-1"))

    shared.ready.release()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, shared.go.wait)

    async def watch_stop() -> None:
        await loop.run_in_executor(None, shared.stop.wait)
        qm.shutdown.set()

    watcher = asyncio.create_task(watch_stop())
    await qm.run(batch_size=int(opts.get("batch_size", 10)), dequeue_timeout=_timedelta(1.0))
    watcher.cancel()
    with contextlib.suppress(Exception):
        await conn.close()


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


class WorkerGroup:
    """``processes`` worker processes of one system, started and ready, released by ``go()``."""

    def __init__(
        self,
        system: str,
        url: str,
        *,
        processes: int,
        threads: int,
        slots: int = 0,
        opts: dict[str, Any] | None = None,
        stub_prefill: int = 0,
    ) -> None:
        self.ctx = mp.get_context("spawn")
        self.shared = Shared(self.ctx, slots)
        self.procs = [
            self.ctx.Process(
                target=worker_process,
                args=(system, url, threads, self.shared, opts or {}, stub_prefill),
                daemon=True,
            )
            for _ in range(processes)
        ]

    def start(self, timeout: float = 120.0) -> None:
        for p in self.procs:
            p.start()
        for _ in self.procs:
            if not self.shared.ready.acquire(timeout=timeout):
                self.close()
                raise RuntimeError("worker process did not become ready")

    def go(self) -> float:
        t0 = time.perf_counter()
        self.shared.go.set()
        return t0

    @property
    def done(self) -> int:
        return self.shared.done

    def wait_for(self, n: int, cap_s: float) -> float | None:
        """perf_counter() when ``n`` actors have run, or None if ``cap_s`` passed first."""
        deadline = time.perf_counter() + cap_s
        while time.perf_counter() < deadline:
            if self.shared.done >= n:
                return time.perf_counter()
            if not any(p.is_alive() for p in self.procs):
                return None
            time.sleep(0.002)
        return None

    def close(self, timeout: float = 30.0) -> None:
        self.shared.go.set()
        self.shared.stop.set()
        deadline = time.monotonic() + timeout
        started = [p for p in self.procs if p.pid is not None]
        for p in started:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.terminate()
                p.join(5)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]


def run_in_thread(target: Any, *args: Any) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def getenv_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
