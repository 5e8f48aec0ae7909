"""The history checker: random operations and random faults, then every promise checked from the record.

In the spirit of Jepsen's Elle and FoundationDB's simulation tests, on a real PostgreSQL and real
``dramatiq`` CLI worker processes (``benchmarks.chaos.checker_app``):

- **Clients** (threads of this process) run random operations: plain sends, keyed sends re-sent
  for 50-250 ms by racing clients as a retrying client would (a small key space, so keys meet
  while their ack is in flight), sends inside ``outbox()`` on a ``Session`` or an ``AsyncSession``
  that commit or roll back (savepoints rolled back inside committed ones, transactions held open
  across two turns of the ring, a send from an ``after_commit`` listener), ``enqueue_many``,
  pipelines, ``on_success`` callbacks, groups with a completion callback, results, and Spark
  writer tasks of the same keys run twice at once (twin tasks) and again later (a retried task),
  and bursts of threads that acquire one window rate limiter all clients share.
  Actors succeed, fail once and retry, or (``slow``) run until ``max_lease`` released their
  message and another delivery took it.
- **Faults**, at random: ``kill -9`` of a worker process (a supervisor restarts its CLI), every
  connection of the workers cut at a TCP proxy for up to 0.8 s, a PostgreSQL restart, a lock
  held on a ring partition, a ``REPEATABLE READ`` reader of ``messages`` holding its snapshot
  for up to 1.5 s; all along, the ring turns every 500 ms and a second reclaimer runs in this
  process.
- **Isolation**: the database's ``default_transaction_isolation`` is set to the level of the run
  (``read committed``, ``repeatable read``, ``serializable``) before anything connects.

At the end (faults stopped, queue drained, workers stopped) :func:`check` compares what the
clients saw (each operation's outcome: committed, rolled back, refused, or unknown when the
commit's reply was lost) with ``chk_runs`` (one row per delivery that ran to its end: message
id, row id, lease, attempts, pid, start, end), history, the hot table, the results and the
business rows, and counts anomalies by kind:

``lost``               a committed (or accepted) send, or a follow-up of an acked delivery,
                       that never ran or is not in history.
``phantom``            a rolled-back or refused send that was stored or ran.
``outbox_mismatch``    a business row without its message, or a message without its row.
``key_twice``          two messages stored for one idempotency key.
``stored_twice``       more history rows for one message than it has deliveries by design
                       (a follow-up written twice, a retry twice).
``duplicate``          a delivery that ran twice outside the documented window: the window
                       holds a second run only if the first run's attempt never reached history
                       and a recorded fault (kill -9 of its process, a cut, a restart, its lease
                       expired) fell between the first run's end and the second's start.
``left_pending``       a row still in the hot table after the drain.
``result_missing``     a completed ``store_results`` message without its result.
``over_limit``         more deliveries of a concurrency key running at one instant than its
                       limit (from the runs' start and end), outside the window of a cut or a
                       restart (the rescuer may then take a live process's claims).
``window_over``        more acquisitions of the window rate limiter admitted than its limit
                       among those that summed one window and added to a bucket of it.

The seed fixes the schedule of operations and faults (which, with what parameters, at what
offsets), not the interleaving of threads and processes.

``python -m benchmarks.chaos.checker [--seed N] [--duration S] [--isolation LEVEL ...]``
prints one line per run and exits 1 on any anomaly; ``python -m benchmarks.chaos --scenarios 11
--duration S`` is the long run of the chaos suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from dramatiq import Message, group, pipeline
from dramatiq.rate_limits import WindowRateLimiter
from psycopg import sql
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox, upgrade
from dramatiq_pg_outbox.rate_limits import PostgresBackend
from dramatiq_pg_outbox.testing import ThrowawayPostgres
from dramatiq_pg_outbox.urls import libpq_url

from . import checker_app
from .harness import Proxy

ROOT = Path(__file__).resolve().parents[2]
LEVELS = ("read committed", "repeatable read", "serializable")
SHORT = {"read committed": "RC", "repeatable read": "RR", "serializable": "SER"}

TABLES = """
CREATE TABLE IF NOT EXISTS chk_runs (
    run uuid PRIMARY KEY,
    token text NOT NULL, step text NOT NULL, message_id text NOT NULL, row_id bigint, lease uuid,
    attempts int, retries int, pid int NOT NULL, started float8 NOT NULL, ended float8 NOT NULL,
    taken_over boolean NOT NULL DEFAULT false, claimed float8
);
CREATE TABLE IF NOT EXISTS chk_orders (token text PRIMARY KEY);
"""

#: Worker settings: short liveness, a short max_lease (``slow`` actors outlive it), the ring
#: turning every 500 ms.
WORKER_SETTINGS = {
    "max_lease": 1_500,
    "max_deliveries": 20,
    "max_fetch_interval": 200,
    "heartbeat_interval": 300,
    "heartbeat_timeout": 1_500,
    "rescue_interval": 200,
    "rotate_interval": 500,
}


# -- what the clients saw ------------------------------------------------------------------------


@dataclass
class Sent:
    """One message a client sent, and what the client saw of it.

    ``outcome``: ``committed`` (its send, or its transaction's commit, returned), ``rolled_back``,
    ``refused`` (``send()`` raised: nothing may be stored), ``unknown`` (the commit's reply was
    lost: stored at most once, and with its business row if it has one).
    ``runs``: how many history rows (and runs) the message has by design (2 for ``retry``).
    """

    token: str
    step: str
    message_id: str
    op: str
    outcome: str
    runs: int = 1
    key: str | None = None
    business: bool = False
    #: Sent by the worker as a follow-up (pipeline step, callback, group completion): expected
    #: exactly when the message it follows completed.
    follows: str | None = None
    #: Its concurrency key and that key's limit (``limited`` operations).
    concurrency_key: str | None = None
    concurrency_limit: int = 0


@dataclass
class Record:
    sent: list[Sent] = field(default_factory=list)
    ops: Counter[str] = field(default_factory=Counter)
    #: (time.time(), kind, pid or None for every worker process)
    faults: list[tuple[float, str, int | None]] = field(default_factory=list)
    spark_keys: dict[str, str] = field(default_factory=dict)  # key -> outcome
    #: After-commit wake-ups the committing threads wrote on the notifier's connection.
    written_at_commit: int = 0
    #: Acquisitions of the shared window limiter (``window`` operations): (the second of the
    #: bucket it added to, the second of the window it summed, ``admitted``/``refused``/``unknown``).
    windows: list[tuple[int, int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *items: Sent) -> None:
        with self.lock:
            self.sent.extend(items)

    def fault(self, kind: str, pid: int | None = None) -> None:
        with self.lock:
            self.faults.append((time.time(), kind, pid))


# -- worker processes ------------------------------------------------------------------------------


class Hosts:
    """``dramatiq benchmarks.chaos.checker_app`` CLIs, restarted when they exit (kill -9 of a worker
    process makes Dramatiq's CLI stop its others and exit)."""

    def __init__(
        self, url: str, record_url: str, logdir: Path, hosts: int, processes: int, threads: int
    ) -> None:
        env = {**os.environ, "CHECK_URL": url, "CHECK_RECORD_URL": record_url}
        env.update({f"CHECK_{k.upper()}": str(v) for k, v in WORKER_SETTINGS.items()})
        self.env = env
        self.args = [
            sys.executable, "-m", "dramatiq", "benchmarks.chaos.checker_app",
            "--processes", str(processes), "--threads", str(threads),
        ]  # fmt: skip
        self.logs = [logdir / f"host{i}.log" for i in range(hosts)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * hosts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, daemon=True)

    def _start(self, i: int) -> None:
        with open(self.logs[i], "ab") as log:
            self.procs[i] = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=log, stderr=log, start_new_session=True
            )

    def start(self) -> Hosts:
        for i in range(len(self.procs)):
            self._start(i)
        self._thread.start()
        return self

    def _supervise(self) -> None:
        while not self._stop.wait(0.1):
            for i, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None and not self._stop.wait(0.3):
                    self._start(i)

    def worker_pids(self) -> list[int]:
        pids = []
        for proc in self.procs:
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(OSError):
                pids += [
                    int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                ]
        return pids

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Report:
    seed: int
    isolation: str
    duration: float
    seconds: float
    ops: Counter[str]
    faults: Counter[str]
    anomalies: Counter[str]
    examples: dict[str, list[str]]
    messages: int
    written_at_commit: int = 0

    def line(self) -> str:
        ops = ",".join(f"{k}={v}" for k, v in sorted(self.ops.items()))
        faults = ",".join(f"{k}={v}" for k, v in sorted(self.faults.items())) or "none"
        anomalies = ",".join(f"{k}={v}" for k, v in sorted(self.anomalies.items())) or "0"
        return (
            f"history-check seed={self.seed} isolation={SHORT[self.isolation]} {self.seconds:.0f}s "
            f"operations={sum(self.ops.values())} ({ops}) messages={self.messages} "
            f"faults={sum(self.faults.values())} ({faults}) wake-ups written at commit="
            f"{self.written_at_commit} anomalies={anomalies} | again: python -m "
            f"benchmarks.chaos.checker --seed {self.seed} --isolation {SHORT[self.isolation]} "
            f"--duration {self.duration:g}"
        )


#: The kinds of client operation (the checker's module docstring says what each does).
KINDS = ("plain", "keyed", "outbox", "outbox_async", "django", "many", "pipeline", "callback", "group")
KINDS += ("spark", "window")

#: The limiter the ``window`` operations of every client share: at most WINDOW_LIMIT acquisitions
#: in any WINDOW_SECONDS consecutive one-second buckets.
WINDOW_KEY, WINDOW_LIMIT, WINDOW_SECONDS = "chk-window", 3, 2


class _RecordedWindow(WindowRateLimiter):
    """Dramatiq's ``WindowRateLimiter``, recording in each thread the seconds of the windows it asks for.

    An acquisition asks three times: for the bucket it adds to (``_acquire``), then the backend
    asks for the window it locks and, once the locks are held, for the window it sums.
    """

    def __init__(self, backend: Any) -> None:
        super().__init__(backend, WINDOW_KEY, limit=WINDOW_LIMIT, window=WINDOW_SECONDS)
        self.asked = threading.local()

    def _get_keys(self) -> list[str]:
        keys: list[str] = super()._get_keys()
        self.asked.seconds.append(int(keys[0].rsplit("@", 1)[1]))
        return keys


class Run:
    """One run: ``duration`` seconds of operations and faults at one isolation default."""

    def __init__(
        self, server: ThrowawayPostgres, dbname: str, seed: int, isolation: str, duration: float, logdir: Path
    ) -> None:
        self.server = server
        self.url = server.url_for(dbname)
        self.seed = seed
        self.isolation = isolation
        self.duration = duration
        self.logdir = logdir
        self.record = Record()
        self.stop_ops = threading.Event()
        self.stop_faults = threading.Event()
        self.proxy = Proxy((server.host, server.port))
        #: The link of half the Spark tasks: an executor far from the database, or one that pauses
        #: (a JVM collection) between statements: 5-250 ms per chunk each way, so that the other
        #: twin commits and its rows are archived between one twin's check of its keys and its
        #: insert (the window of the reverted defect 4, docs/chaos.md). The other half write
        #: directly, so that two twins' statements interleave within milliseconds.
        self.slow_link = Proxy((server.host, server.port), latency=(0.005, 0.25))
        proxied = make_url(self.url).set(host="127.0.0.1", port=self.proxy.port)
        self.worker_url = proxied.render_as_string(hide_password=False)
        self.spark_conninfo = libpq_url(make_url(self.url).set(host="127.0.0.1", port=self.slow_link.port))
        self.rng = random.Random(seed)
        self.errors: list[str] = []
        self.epoch = 0
        self.big_spark_task = 1_500
        #: Extra weight of some operation kinds (``--weight spark=10``): a kind of weight N is drawn
        #: N times as often as with the default mix, where every kind has weight 1.
        self.weights: dict[str, int] = {}

    # -- clients --------------------------------------------------------------------------------

    def _client(self, index: int, rng: random.Random) -> None:
        # The third client's wake-ups are sent after commit, its sessions' on the notifier's
        # connection, which the faults break as they break the others.
        notify = "after_commit" if index == 2 else "transaction"
        broker = checker_app.make_broker(self.url, max_fetch_interval=200, notify=notify)
        actors = checker_app.declare(broker)
        engine = create_engine("postgresql+psycopg://" + self.url.split("://", 1)[1], pool_pre_ping=True)
        async_engine = create_async_engine("postgresql+psycopg://" + self.url.split("://", 1)[1])
        loop = asyncio.new_event_loop()
        # The default mix, in the order the seeds' schedules were drawn from: outbox() twice.
        kinds = ["plain", "keyed", "outbox", "outbox", "outbox_async", "django"]
        kinds += ["many", "pipeline", "callback", "group", "limited"]
        if index < 2:
            kinds += ["spark"]
        kinds += ["window"]
        kinds += [kind for kind in kinds if kind in self.weights for _ in range(self.weights[kind] - 1)]
        n = 0
        try:
            while not self.stop_ops.is_set():
                kind = rng.choice(kinds)
                n += 1
                token = f"c{index}-{n}"
                try:
                    dramatiq.set_broker(broker)
                    if kind == "outbox_async":
                        loop.run_until_complete(self._outbox_async(async_engine, broker, actors, token, rng))
                    else:
                        getattr(self, f"_op_{kind}")(engine, broker, actors, token, rng)
                    with self.record.lock:
                        self.record.ops[kind] += 1
                except Exception as e:  # its outcome is recorded (rolled back or unknown)
                    with self.record.lock:
                        self.record.ops[f"{kind}_error"] += 1
                    if not _expected_error(e):
                        detail = " ".join(str(e).split("[SQL:")[0].split())
                        self.errors.append(f"{kind} {token}: {type(e).__name__}: {detail[:500]}")
                time.sleep(rng.uniform(0, 0.02))
        finally:
            loop.run_until_complete(async_engine.dispose())
            loop.close()
            engine.dispose()
            notifier = broker.runtime.flusher.notifier if broker.has_runtime else None
            if notifier is not None:
                with self.record.lock:
                    self.record.written_at_commit += notifier.sent
            checker_app.close_broker(broker)

    def _mode(self, rng: random.Random, slow: int = 5) -> tuple[str, int]:
        """An actor's behaviour: ``slow`` outlives its lease (more often for a message with follow-ups)."""
        mode = rng.choices(["ok", "retry", "slow"], weights=[80, 15, slow])[0]
        return mode, 2 if mode == "retry" else 1

    def _send(
        self, actors: dict[str, Any], token: str, step: str, mode: str, op: str, **options: Any
    ) -> Sent:
        message = actors["rec"].message_with_options(args=(token, step, mode), **options)
        runs = 2 if mode == "retry" else 1
        return Sent(
            token, step, message.message_id, op, "pending", runs, key=options.get("idempotency_key")
        ), message

    def _op_plain(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        mode, _ = self._mode(rng)
        sent, message = self._send(actors, token, "main", mode, "plain")
        self._enqueue(broker, [sent], [message])

    def _enqueue(self, broker: PostgresBroker, sent: list[Sent], messages: list[Message[Any]]) -> None:
        if len(messages) > 1:
            self._recorded(sent, lambda: broker.enqueue_many(messages))
        else:
            self._recorded(sent, lambda: broker.enqueue(messages[0]))

    def _recorded(self, sent: list[Sent], action: Callable[[], object]) -> None:
        """Run ``action`` (sends outside a transaction of ours): committed if it returned, else unknown."""
        try:
            action()
        except Exception:
            for s in sent:
                s.outcome = "unknown"
            self.record.add(*sent)
            raise
        for s in sent:
            s.outcome = "committed"
        self.record.add(*sent)

    def _op_many(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        pairs = [
            self._send(actors, token, f"m{i}", self._mode(rng)[0], "many") for i in range(rng.randint(2, 5))
        ]
        self._enqueue(broker, [s for s, _ in pairs], [m for _, m in pairs])

    def _op_limited(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        # A few concurrency keys (limit 1 or 2, fixed per key) whose messages hold their slot
        # 20-100 ms (``hold``), sent in bursts of 2-8 by racing clients, some failing once (a retry
        # keeps the key); never ``slow``: a claim that max_lease takes from a running actor is
        # outside the limit's promise (docs/guides/concurrency.md).
        number = rng.randint(0, 3)
        key, limit = f"lim-{number}", 1 + number % 2
        pairs = []
        for i in range(rng.randint(2, 8)):
            mode = "retry" if rng.random() < 0.15 else "hold"
            sent, message = self._send(
                actors, token, f"l{i}", mode, "limited", concurrency_key=key, concurrency_limit=limit
            )
            sent.concurrency_key, sent.concurrency_limit = key, limit
            pairs.append((sent, message))
        self._enqueue(broker, [s for s, _ in pairs], [m for _, m in pairs])

    def _op_keyed(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        # A small key space: the keys of the last few epochs, re-sent by racing clients.
        with self.record.lock:
            if rng.random() < 0.3:
                self.epoch += 1
            key = f"key-{max(0, self.epoch - rng.randint(0, 2))}"
        until = time.monotonic() + rng.uniform(0.05, 0.25)
        i = 0
        while time.monotonic() < until and not self.stop_ops.is_set():
            i += 1
            sent, message = self._send(actors, f"{token}.{i}", "keyed", "ok", "keyed", idempotency_key=key)
            self._enqueue(broker, [sent], [message])
            time.sleep(rng.uniform(0.001, 0.01))

    def _outbox_body(
        self, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random, session: Any
    ) -> tuple[list[Sent], list[Sent], Callable[[], None] | None]:
        """Sends of one outbox transaction: (in the transaction, in a rolled-back savepoint, after_commit)."""
        mode, _ = self._mode(rng)
        sent, message = self._send(actors, token, "main", mode, "outbox")
        sent.business = True
        broker.enqueue(message)
        lost_in_savepoint: list[Sent] = []
        kept = [sent]
        if rng.random() < 0.3:
            nested = session.begin_nested()
            extra, message2 = self._send(actors, token, "nested", "ok", "outbox")
            broker.enqueue(message2)
            if rng.random() < 0.5:
                nested.rollback()
                lost_in_savepoint.append(extra)
            else:
                nested.commit()
                kept.append(extra)
        return kept, lost_in_savepoint, None

    def _op_outbox(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        commit = rng.random() < 0.8
        hold = rng.random() < 0.1
        after: list[Sent] = []
        kept: list[Sent] = []
        dropped: list[Sent] = []
        committing = False
        try:
            with Session(engine) as session, outbox(session, broker):
                session.execute(text("INSERT INTO chk_orders (token) VALUES (:t)"), {"t": token})
                kept, dropped, _ = self._outbox_body(broker, actors, token, rng, session)
                if commit and rng.random() < 0.3:
                    # A send from an after_commit listener, inside outbox().
                    def on_commit(s: Any) -> None:
                        sent, message = self._send(actors, token, "after_commit", "ok", "after_commit")
                        try:
                            broker.enqueue(message)
                            sent.outcome = "committed"
                        except Exception:
                            sent.outcome = "refused"
                        after.append(sent)

                    event.listen(session, "after_commit", on_commit, once=True)
                if hold:  # across two turns of the ring
                    time.sleep(2.2 * WORKER_SETTINGS["rotate_interval"] / 1000)
                committing = commit
                session.commit() if commit else session.rollback()
        except Exception as e:
            # Before the COMMIT, or a COMMIT refused by a serialization failure: rolled back.
            certain = not committing or _serialization_failure(e)
            for s in kept:
                s.outcome = "rolled_back" if certain else "unknown"
            for s in dropped:
                s.outcome = "rolled_back"
            self.record.add(*kept, *dropped, *after)
            raise
        for s in kept:
            s.outcome = "committed" if commit else "rolled_back"
        for s in dropped:
            s.outcome = "rolled_back"
        self.record.add(*kept, *dropped, *after)
        with self.record.lock:
            self.record.ops["after_commit_send"] += len(after)
            self.record.ops["held_across_turns"] += hold

    async def _outbox_async(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        commit = rng.random() < 0.8
        mode, _ = self._mode(rng)
        sent, message = self._send(actors, token, "main", mode, "outbox_async")
        sent.business = True
        committing = False
        try:
            async with AsyncSession(engine) as session:
                async with outbox(session, broker):
                    await session.execute(text("INSERT INTO chk_orders (token) VALUES (:t)"), {"t": token})
                    broker.enqueue(message)
                committing = commit
                await (session.commit() if commit else session.rollback())
        except Exception as e:
            certain = not committing or _serialization_failure(e)
            sent.outcome = "rolled_back" if certain else "unknown"
            self.record.add(sent)
            raise
        sent.outcome = "committed" if commit else "rolled_back"
        self.record.add(sent)

    def _op_django(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        """A send inside Django's ``transaction.atomic()`` with ``dramatiq_pg_outbox.django.outbox``."""
        from django.db import connections, transaction

        from dramatiq_pg_outbox.django import outbox as django_outbox

        alias = _django_database(self.url)
        commit = rng.random() < 0.8
        mode, _ = self._mode(rng)
        sent, message = self._send(actors, token, "main", mode, "django")
        sent.business = True
        nested_sent, nested = self._send(actors, token, "nested", "ok", "django")
        nested_kept = rng.random() < 0.5
        hold = rng.random() < 0.15
        try:
            with transaction.atomic(using=alias), django_outbox(using=alias, broker=broker):
                with connections[alias].cursor() as cursor:
                    cursor.execute("INSERT INTO chk_orders (token) VALUES (%s)", [token])
                broker.enqueue(message)
                try:
                    with transaction.atomic(using=alias):
                        broker.enqueue(nested)
                        if not nested_kept:
                            raise _RollBack
                except _RollBack:
                    pass
                if hold:  # its rows written at once, then held across two turns of the ring
                    time.sleep(2.2 * WORKER_SETTINGS["rotate_interval"] / 1000)
                if not commit:
                    transaction.set_rollback(True, using=alias)
        except Exception as e:
            certain = _serialization_failure(e)
            sent.outcome = nested_sent.outcome = "rolled_back" if certain else "unknown"
            if not nested_kept:
                nested_sent.outcome = "rolled_back"
            self.record.add(sent, nested_sent)
            connections[alias].close()
            raise
        sent.outcome = "committed" if commit else "rolled_back"
        nested_sent.outcome = "committed" if commit and nested_kept else "rolled_back"
        self.record.add(sent, nested_sent)
        with self.record.lock:
            self.record.ops["held_across_turns"] += hold

    def _op_pipeline(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        mode, runs = self._mode(rng, slow=30)
        first = actors["rec"].message_with_options(args=(token, "p1", mode), pipe_ignore=True)
        second = actors["rec"].message_with_options(args=(token, "p2", "ok"), pipe_ignore=True)
        pipe = pipeline([first, second], broker=broker)
        sent = [
            Sent(token, "p1", first.message_id, "pipeline", "pending", runs),
            Sent(token, "p2", second.message_id, "pipeline", "pending", 1, follows=first.message_id),
        ]
        self._recorded(sent, pipe.run)

    def _op_callback(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        mode, _ = self._mode(rng, slow=30)
        sent, message = self._send(actors, token, "cb_src", mode, "callback", on_success=actors["callback"])
        # The callback's message id is made by the worker: checked by token (see check()).
        self._enqueue(broker, [sent], [message])

    def _op_group(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        members = [actors["rec"].message(token, f"g{i}", self._mode(rng)[0]) for i in range(3)]
        done = actors["rec"].message(token, "gdone", "ok")
        g = group(members, broker=broker)
        g.add_completion_callback(done)
        sent = [
            Sent(token, f"g{i}", m.message_id, "group", "pending", 2 if m.args[2] == "retry" else 1)
            for i, m in enumerate(members)
        ]
        sent.append(Sent(token, "gdone", done.message_id, "group", "pending", 1, follows="group"))
        self._recorded(sent, g.run)

    def _op_window(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        # A burst of 2-6 threads that acquire the window limiter every client shares (its
        # transaction: BEGIN with the window's locks, then the sum with the COMMIT), through the
        # faults (a restart ends them with an error: an unknown outcome).
        backend = PostgresBackend(broker=broker, cleanup_interval=None, listen=False)
        limiter = _RecordedWindow(backend)

        failed: list[Exception] = []

        def acquire() -> None:
            seen: list[int] = []
            limiter.asked.seconds = seen
            outcome = "unknown"
            try:
                with limiter.acquire(raise_on_failure=False) as acquired:
                    outcome = "admitted" if acquired else "refused"
            except Exception as e:  # raised again by the operation, for the client to count
                failed.append(e)
            finally:
                if seen:
                    with self.record.lock:
                        self.record.windows.append((seen[0], seen[-1], outcome))

        try:
            burst = [threading.Thread(target=acquire) for _ in range(rng.randint(2, 6))]
            for thread in burst:
                thread.start()
            for thread in burst:
                thread.join()
        finally:
            backend.close()
        if failed:
            raise failed[0]

    def _op_spark(
        self, engine: Any, broker: PostgresBroker, actors: dict[str, Any], token: str, rng: random.Random
    ) -> None:
        from dramatiq_pg_outbox.spark.encoding import Plan
        from dramatiq_pg_outbox.spark.write import write_partition

        # Drawn from the token, not from rng: the seeds' schedules stay those of earlier runs.
        slow = random.Random(token).random() < 0.5
        conninfo = self.spark_conninfo if slow else broker.conninfo
        plan = Plan.build(
            key="key", args=["key"], conninfo=conninfo, schema="dramatiq", channel=broker.channel,
            queue_name=checker_app.QUEUE, actor_name="spark_rec", batch_id=token, options={}, delay_ms=0,
            notify=True, encoder=dramatiq.get_encoder(),
        )  # fmt: skip
        big = self.big_spark_task
        size = rng.randint(3, 30) if rng.random() < 0.7 else rng.randint(big // 5, big)
        rows = [(f"s{token}-{i}",) for i in range(size)]
        # The twin starts within 30 ms on a direct link; on the slow one, as Spark's speculation
        # launches a copy of a task that is slow (spark.speculation.multiplier), up to 2.5 s after
        # the original (one draw either way: the seeds' schedules stay those of earlier runs).
        offset = rng.random() * (2.5 if slow else 0.03)
        outcomes: list[str] = []

        def task(delay: float = 0.0) -> None:
            time.sleep(delay)
            try:
                write_partition(plan, rows)
                outcomes.append("committed")
            except Exception:
                outcomes.append("unknown")

        twins = [threading.Thread(target=task, args=(d,)) for d in (0.0, offset)]
        for t in twins:
            t.start()
        for t in twins:
            t.join()
        if rng.random() < 0.5:  # the task retried after some of its rows ran
            time.sleep(rng.uniform(0.01, 0.2))
            task()
        outcome = "committed" if "committed" in outcomes else "unknown"
        with self.record.lock:
            for (key,) in rows:
                self.record.spark_keys[key] = outcome

    # -- faults ---------------------------------------------------------------------------------

    def _faults(self, hosts: Hosts) -> None:
        rng = random.Random(self.seed * 7919 + 1)
        last_restart = time.monotonic()
        while not self.stop_faults.wait(rng.uniform(0.3, 1.2)):
            kind = rng.choices(["kill", "cut", "restart", "lock", "reader"], weights=[3, 3, 1, 2, 2])[0]
            if kind == "restart" and time.monotonic() - last_restart < 6:
                kind = "cut"
            try:
                if kind == "kill":
                    pids = hosts.worker_pids()
                    if pids:
                        victim = rng.choice(sorted(pids))
                        self.record.fault("kill", victim)
                        os.kill(victim, signal.SIGKILL)
                elif kind == "cut":
                    self.record.fault("cut")
                    self.proxy.block()
                    time.sleep(rng.uniform(0.05, 0.8))
                    self.proxy.unblock()
                    self.record.fault("cut_end")
                elif kind == "restart":
                    last_restart = time.monotonic()
                    self.record.fault("restart")
                    self.server.restart("fast" if rng.random() < 0.7 else "immediate")
                    self.record.fault("restart_end")
                elif kind == "lock":
                    self._hold(rng, "lock")
                else:
                    self._hold(rng, "reader")
            except Exception as e:
                self.errors.append(f"fault {kind}: {type(e).__name__}: {e}")
        self.proxy.unblock()

    def _hold(self, rng: random.Random, kind: str) -> None:
        """A lock on one ring partition, or a REPEATABLE READ reader of messages, held a while."""
        with psycopg.connect(self.url, connect_timeout=5) as conn:
            if kind == "lock":
                parts = [r[0] for r in conn.execute(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "WHERE i.inhparent = 'dramatiq.messages'::regclass AND c.relname LIKE 'messages_ring%%'"
                ).fetchall()]  # fmt: skip
                if parts:
                    conn.execute(
                        sql.SQL("LOCK TABLE dramatiq.{} IN ACCESS SHARE MODE").format(
                            sql.Identifier(rng.choice(parts))
                        )
                    )
            else:
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                conn.execute("SELECT count(*) FROM dramatiq.messages")
            self.record.fault(kind)
            time.sleep(rng.uniform(0.05, 1.5 if kind == "reader" else 0.5))
            conn.rollback()

    def _second_reclaimer(self) -> None:
        from dramatiq_pg_outbox._runtime.reclaimer import Reclaimer

        broker = PostgresBroker(url=self.url, rotate_interval=WORKER_SETTINGS["rotate_interval"])
        try:
            reclaimer = Reclaimer(broker.runtime)
            while not self.stop_faults.wait(random.uniform(0.05, 0.25)):
                try:
                    reclaimer.run_once()
                except Exception as e:
                    if not _expected_error(e):
                        self.errors.append(f"second reclaimer: {type(e).__name__}: {e}")
        finally:
            broker.close()

    # -- the run --------------------------------------------------------------------------------

    def run(self, clients: int = 3, hosts: int = 2, processes: int = 1, threads: int = 8) -> Report:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(TABLES)
        started = time.monotonic()
        workers = Hosts(self.worker_url, self.url, self.logdir, hosts, processes, threads).start()
        background: list[threading.Thread] = []
        try:
            _wait(lambda: len(workers.worker_pids()) >= hosts * processes, 60, "worker processes")
            seeds = [self.rng.randrange(2**32) for _ in range(clients)]
            background = [
                threading.Thread(target=self._client, args=(i, random.Random(seeds[i])), daemon=True)
                for i in range(clients)
            ]
            background += [
                threading.Thread(target=self._faults, args=(workers,), daemon=True),
                threading.Thread(target=self._second_reclaimer, daemon=True),
            ]
            for t in background:
                t.start()
            time.sleep(self.duration)
            self.stop_ops.set()
            for t in background[:clients]:
                t.join(60)
            self.stop_faults.set()
            for t in background[clients:]:
                t.join(60)
            self.proxy.unblock()
            drained = _drain(self.url, timeout=90)
        finally:
            self.stop_ops.set()
            self.stop_faults.set()
            workers.stop()
            self.proxy.close()
            self.slow_link.close()
        anomalies, examples, messages = check(self.url, self.record, drained)
        if self.errors:
            anomalies["client_error"] += len(self.errors)
            examples["client_error"] = self.errors[:5]
        faults = Counter(k for _, k, _ in self.record.faults if not k.endswith("_end"))
        seconds = time.monotonic() - started
        return Report(self.seed, self.isolation, self.duration, seconds, self.record.ops, faults, anomalies,
                      examples, messages, self.record.written_at_commit)  # fmt: skip


def _serialization_failure(e: BaseException) -> bool:
    return isinstance(e, psycopg.errors.SerializationFailure) or "could not serialize" in str(e)


def _expected_error(e: BaseException) -> bool:
    """What a fault makes a client see: a lost connection, a restart, a serialization failure."""
    text = str(e).lower()
    return (
        isinstance(e, (psycopg.OperationalError, OSError, TimeoutError))
        or _serialization_failure(e)
        or any(w in text for w in ("connection", "shutting down", "terminating", "timeout", "deadlock"))
    )


class _RollBack(Exception):
    """Raised inside a nested ``atomic()`` to roll its savepoint back."""


_django_lock = threading.Lock()


def _django_database(url: str) -> str:
    """The Django database alias of ``url``, configured on first use (Django set up once per process)."""
    import django
    from django.conf import settings
    from django.db import connections

    parts = make_url(url)
    alias = f"check_{parts.database}"
    with _django_lock:
        config = {
            "ENGINE": "django.db.backends.postgresql", "NAME": parts.database, "USER": parts.username,
            "PASSWORD": parts.password or "", "HOST": parts.host, "PORT": parts.port,
        }  # fmt: skip
        if not settings.configured:
            # Django wants a default database: the first run's (the checker names each run's alias).
            settings.configure(DATABASES={"default": dict(config)}, USE_TZ=True, INSTALLED_APPS=[])
            django.setup()
        if alias not in connections.settings:
            configured = connections.configure_settings({"default": dict(config), alias: config})
            connections.settings[alias] = configured[alias]
    return alias


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _drain(url: str, timeout: float) -> bool:
    """Until the hot table has been empty for a second (follow-ups come after their ack)."""
    deadline = time.monotonic() + timeout
    empty_since: float | None = None
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                n = conn.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0]  # type: ignore[index]
        except psycopg.OperationalError:
            n = -1
        if n == 0:
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since >= 1.5:
                return True
        else:
            empty_since = None
        time.sleep(0.2)
    return False


# -- the check -------------------------------------------------------------------------------------


def check(url: str, record: Record, drained: bool) -> tuple[Counter[str], dict[str, list[str]], int]:
    """Every promise, from the clients' record and the tables.  Returns (anomalies, examples, messages)."""
    anomalies: Counter[str] = Counter()
    examples: dict[str, list[str]] = defaultdict(list)

    def bad(kind: str, detail: str) -> None:
        anomalies[kind] += 1
        if len(examples[kind]) < 5:
            examples[kind].append(detail)

    with psycopg.connect(url, autocommit=True) as conn:
        runs = conn.execute(
            "SELECT token, step, message_id, row_id, attempts, pid, started, ended, taken_over, claimed "
            "FROM chk_runs ORDER BY started"
        ).fetchall()
        history = conn.execute(
            "SELECT id, message_id, state, attempts, idempotency_key, actor_name, payload "
            "FROM dramatiq.history"
        ).fetchall()
        left = conn.execute("SELECT id, message_id, state FROM dramatiq.messages").fetchall()
        orders = {r[0] for r in conn.execute("SELECT token FROM chk_orders").fetchall()}
        results = {r[0] for r in conn.execute("SELECT message_key FROM dramatiq.results").fetchall()}

    #: Messages still in the hot table: reported once, as left_pending, not again as lost.
    pending = {str(message_id) for _, message_id, _ in left}
    for row_id, message_id, state in left:
        bad("left_pending", f"row {row_id} message {message_id} {state}")
    if not drained and not left:
        bad("left_pending", "the queue did not stay empty")

    hist_by_mid: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    hist_by_row: dict[int, tuple[Any, ...]] = {}
    for h in history:
        hist_by_mid[h[1]].append(h)
        hist_by_row[int(h[0])] = h
    runs_by_mid: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    runs_by_row: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for r in runs:
        runs_by_mid[r[2]].append(r)
        if r[3] is not None:
            runs_by_row[int(r[3])].append(r)

    # 1. Each delivery ran once, or twice inside the documented window.
    for row_id, deliveries in runs_by_row.items():
        # In claim order (attempts): a delivery claimed first may start last (held in a buffer).
        ordered = sorted(deliveries, key=lambda r: (r[4] or 0, r[6]))
        for first, second in itertools.pairwise(ordered):
            archived = hist_by_row.get(row_id)
            reached_history = archived is not None and archived[3] == first[4]
            if reached_history or not _fault_between(record, first, second):
                near = [
                    f"{k}@{at - first[7]:+.2f}s({v})" for at, k, v in record.faults if abs(at - first[7]) < 3
                ]
                bad(
                    "duplicate",
                    f"row {row_id} {first[0]}/{first[1]} ran at attempts {first[4]} (pid {first[5]}, "
                    f"{first[7] - first[6]:.2f}s, ended {first[7]:.2f}) and {second[4]} (pid {second[5]}, "
                    f"started {second[6] - first[7]:+.2f}s); archived attempts "
                    f"{archived[3] if archived else None}; faults near: {' '.join(near) or 'none'}",
                )

    # 2. What the clients sent.
    by_token_step = {(s.token, s.step): s for s in record.sent}
    group_members: dict[str, list[Sent]] = defaultdict(list)
    for s in record.sent:
        if s.op == "group" and s.step != "gdone":
            group_members[s.token].append(s)
    completed: set[str] = set()
    for s in record.sent:
        rows = hist_by_mid.get(s.message_id, [])
        ran = runs_by_mid.get(s.message_id, [])
        if rows and all(r[2] == "completed" for r in rows[-1:]):
            completed.add(s.message_id)
        if s.follows is not None:
            continue  # checked with what it follows, below
        if s.outcome == "committed" and s.key is None and s.message_id not in pending:
            if len(rows) < s.runs or len({r[3] for r in ran}) < s.runs:
                bad(
                    "lost",
                    f"{s.op} {s.token}/{s.step} {s.message_id}: {len(rows)} history rows, {len(ran)} runs",
                )
        if s.outcome in ("rolled_back", "refused") and (rows or ran):
            bad(
                "phantom",
                f"{s.op} {s.token}/{s.step} {s.outcome} but stored ({len(rows)}) / ran ({len(ran)})",
            )
        if len(rows) > s.runs:
            bad(
                "stored_twice",
                f"{s.op} {s.token}/{s.step} {s.message_id}: {len(rows)} history rows, {s.runs} by design",
            )
        if s.business and s.step == "main":
            stored = bool(rows) or s.message_id in pending
            if (s.token in orders) != stored:
                bad(
                    "outbox_mismatch",
                    f"{s.op} {s.token}: business row {s.token in orders}, message {stored}",
                )

    # 3. Follow-ups: written exactly once when what they follow completed.
    for s in record.sent:
        if s.follows is None or s.outcome == "rolled_back":
            continue
        rows = hist_by_mid.get(s.message_id, [])
        if s.follows == "group":
            members = group_members[s.token]
            expected = all(_done(hist_by_mid, m) for m in members) and s.outcome == "committed"
        else:
            expected = _done(hist_by_mid, by_token_step[(s.token, "p1")]) if s.step == "p2" else False
        if len(rows) > 1:
            bad("stored_twice", f"follow-up {s.token}/{s.step}: {len(rows)} history rows")
        elif expected and not rows:
            bad("lost", f"follow-up {s.token}/{s.step} of a completed message never stored")
    callbacks = Counter(r[0] for r in runs if r[1] == "callback")
    for s in record.sent:
        if s.step == "cb_src" and s.outcome == "committed":
            n = callbacks.get(s.token, 0)
            if n == 0 and _done(hist_by_mid, s):
                bad("lost", f"on_success callback of {s.token} never ran")
    callback_rows = Counter(Message.decode(bytes(h[6])).args[1] for h in history if h[5] == "callback")
    for token, n in callback_rows.items():
        if n > 1:
            bad("stored_twice", f"on_success callback of {token}: {n} history rows")

    # 4. Idempotency keys: one message per key; a committed keyed send leaves exactly one.
    keyed: dict[str, set[str]] = defaultdict(set)
    for h in history:
        if h[4] is not None:
            keyed[h[4]].add(h[1])
    for key, mids in keyed.items():
        if len(mids) > 1:
            bad("key_twice", f"key {key}: {len(mids)} messages")
    sent_keys = {s.key for s in record.sent if s.key is not None and s.outcome == "committed"}
    for key in sent_keys:
        if not keyed.get(key):
            bad("lost", f"key {key}: sent, never stored")
    spark_runs = Counter(r[0] for r in runs if r[1] == "spark")
    # A Spark row's message id derives from its key: twin tasks store the same message id twice.
    spark_rows = Counter(Message.decode(bytes(h[6])).args[0] for h in history if h[5] == "spark_rec")
    for key, outcome in record.spark_keys.items():
        if spark_rows.get(key, 0) > 1:
            bad("key_twice", f"spark key {key}: {spark_rows[key]} history rows")
        if outcome == "committed" and not spark_runs.get(key):
            bad("lost", f"spark key {key}: written, never ran")

    # 5. Concurrency keys: at no instant more deliveries of a key running than its limit, but
    # inside the documented window: a delivery whose claim was taken while it ran (its row no
    # longer carried its lease when it ended: max_lease, here 1.5 s from the claim, buffer time
    # included, or the rescuer after a missed heartbeat), or a cut or a restart after which the
    # rescuer may have taken the claims of a process still running their actors; a kill -9
    # leaves no run.
    limited = {s.message_id: s for s in record.sent if s.concurrency_key is not None}
    spans: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for r in runs:
        sent = limited.get(r[2])
        if sent is not None and sent.concurrency_key is not None and r[9] is not None:
            spans[sent.concurrency_key].append((float(r[6]), float(r[7]), int(r[5])))
    limits = {s.concurrency_key: s.concurrency_limit for s in limited.values()}
    for key, intervals in spans.items():
        for at, running in _over(intervals, limits[key]):
            # The window: the rescuer released a running delivery's claim after a cut or a
            # restart, between that delivery's start (its claim, up to 2 s earlier when it
            # waited in a worker's buffer) and the instant the limit was passed.
            since = min(start for start, _, _ in running) - 2.0
            if not _fault_near(record, since, at):
                pids = sorted({pid for _, _, pid in running})
                bad(
                    "over_limit",
                    f"key {key} (limit {limits[key]}): {len(running)} running at {at:.3f}, pids {pids}",
                )

    # 6. The window limiter: of the acquisitions admitted that summed one window (the seconds
    # t - WINDOW_SECONDS + 1 to t) and added to a bucket of it, at most its limit. Each of them
    # held the locks of that window's keys when it summed, so it saw every one committed before
    # it. (One that added to an older bucket, having waited past it for its locks, counts in
    # windows it did not sum: Dramatiq's RedisBackend allows that too.)
    admitted: Counter[int] = Counter()
    for bucket, summed, outcome in record.windows:
        if outcome == "admitted" and summed - WINDOW_SECONDS < bucket <= summed:
            admitted[summed] += 1
    for window_end, count in sorted(admitted.items()):
        if count > WINDOW_LIMIT:
            bad(
                "window_over",
                f"{count} admitted summing the window ending at second {window_end} (limit {WINDOW_LIMIT})",
            )

    # 7. Results (written with the ack): every completed rec message stored its result.
    for h in history:
        if h[5] == "rec" and h[2] == "completed":
            message = Message.decode(bytes(h[6]))
            if message.options.get("retries", 0) == 0 and message.args[2] == "retry":
                continue  # the first delivery of a retry message failed (archived completed, with its error)
            if _result_key(message) not in results:
                bad("result_missing", f"{message.args[0]}/{message.args[1]} {message.message_id}")
    return anomalies, dict(examples), len(history)


def _over(
    intervals: list[tuple[float, float, int]], limit: int
) -> list[tuple[float, list[tuple[float, float, int]]]]:
    """Each instant at which more than ``limit`` of the intervals ``(start, end, pid)`` overlap
    (a start), with the intervals running then."""
    found = []
    for start, _, _ in intervals:
        running = [i for i in intervals if i[0] <= start < i[1]]
        if len(running) > limit:
            found.append((start, running))
    return found


def _fault_near(record: Record, since: float, at: float) -> bool:
    """Whether a cut or a restart may have had effects between ``since`` and ``at``: from its
    start to its end plus the workers' ``heartbeat_timeout`` and the flusher's 5 s longest
    backoff, as ``_fault_between``."""
    after = (WORKER_SETTINGS["heartbeat_timeout"] + 5_000) / 1000
    ends = {"cut": "cut_end", "restart": "restart_end"}
    for i, (start, kind, _) in enumerate(record.faults):
        if kind in ends:
            until = next((t for t, k, _ in record.faults[i + 1 :] if k == ends[kind]), float("inf")) + after
            if start <= at and until >= since:
                return True
    return False


def _result_key(message: Message[Any]) -> str:
    """The results backend's key of a message (Dramatiq's: md5 of namespace, queue, actor, message id)."""
    key = f"dramatiq-results:{message.queue_name}:{message.actor_name}:{message.message_id}"
    return hashlib.md5(key.encode()).hexdigest()  # Dramatiq's key, not a secret


def _done(hist_by_mid: dict[str, list[tuple[Any, ...]]], s: Sent) -> bool:
    """Whether a message completed in the end (its last history row is completed, with no error)."""
    rows = hist_by_mid.get(s.message_id, [])
    return len(rows) >= s.runs and any(r[2] == "completed" for r in rows)


def _fault_between(record: Record, first: tuple[Any, ...], second: tuple[Any, ...]) -> bool:
    """Whether ``first`` may have run again as ``second`` inside the documented window.

    Its lease was gone when it ended (``claimed`` NULL: max_lease, or the rescuer), or could have
    expired before its ack (claimed ``max_lease`` before ``second`` started), or a recorded fault
    hit its process between its end and ``second``'s start: a kill -9 of it, or a cut or restart,
    whose effects last until the process has reconnected and heartbeated again (its
    ``heartbeat_timeout`` plus the flusher's 5 s longest backoff).
    """
    pid, ended, started_again, claimed = first[5], first[7], second[6], first[9]
    if claimed is None or claimed + WORKER_SETTINGS["max_lease"] / 1000 <= started_again:
        return True  # its lease expired or was released
    after = (WORKER_SETTINGS["heartbeat_timeout"] + 5_000) / 1000
    ends = {"cut": "cut_end", "restart": "restart_end"}
    for i, (at, kind, victim) in enumerate(record.faults):
        if kind == "kill" and victim == pid and ended - 0.05 <= at <= started_again:
            return True
        if kind in ends:
            until = next((t for t, k, _ in record.faults[i + 1 :] if k == ends[kind]), float("inf")) + after
            if at <= started_again and until >= ended:
                return True
    return False


# -- entry points ----------------------------------------------------------------------------------


@contextlib.contextmanager
def database(server: ThrowawayPostgres, isolation: str) -> Iterator[str]:
    """A fresh migrated database on ``server`` whose default isolation is ``isolation``."""
    name = f"check_{secrets.token_hex(4)}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        upgrade(server.url_for(name), schema="dramatiq")
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = {}").format(
                    sql.Identifier(name), sql.Literal(isolation)
                )
            )
        yield name
    finally:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def run_levels(
    seed: int,
    duration: float,
    levels: tuple[str, ...] = LEVELS,
    logdir: Path | None = None,
    big_spark_task: int = 1_500,
    weights: dict[str, int] | None = None,
) -> list[Report]:
    """One run per isolation level (each with ``seed``) on one throwaway server, which the runs
    restart; prints and returns one report per run.

    Parameters:
      seed(int): The schedule's seed.
      duration(float): Seconds of operations per level (then the drain, up to 90 s).
      big_spark_task(int): Rows of the largest Spark writer task (the short run of the tests
        uses fewer, to drain sooner).
      weights(dict[str, int] | None): Weight of some operation kinds (default: 1 each), e.g.
        ``{"spark": 10}`` to look at the Spark writer's twin tasks.
    """
    logdir = logdir or Path(tempfile.mkdtemp(prefix="history-check-"))
    reports = []
    # fsync off: a restart of the server is not a crash of the machine, and the runs are I/O bound.
    with ThrowawayPostgres({"max_connections": 300, "fsync": "off"}) as server:
        for level in levels:
            with database(server, level) as name:
                run = Run(server, name, seed, level, duration, logdir)
                run.big_spark_task = big_spark_task
                run.weights = dict(weights or {})
                report = run.run()
            print(report.line(), flush=True)
            for kind, items in report.examples.items():
                for item in items:
                    print(f"    {kind}: {item}", flush=True)
            reports.append(report)
    return reports


def history_checker(ctx: Any) -> Any:
    """Chaos scenario 11: the checker, ``ctx.duration`` seconds under each isolation default.

    Runs on a throwaway server of its own (it restarts PostgreSQL), whatever ``--url`` says.
    """
    from .scenarios import Result

    seed = ctx.seed if ctx.seed is not None else random.randrange(2**31)
    reports = run_levels(seed, ctx.duration, logdir=ctx.logdir)
    anomalies = sum((r.anomalies for r in reports), Counter())
    notes = "; ".join(
        f"{SHORT[r.isolation]}: {sum(r.ops.values())} operations, {sum(r.faults.values())} faults, "
        f"anomalies {dict(r.anomalies) or 0}"
        for r in reports
    )
    lost = anomalies["lost"] + anomalies["outbox_mismatch"]
    doubled = anomalies["duplicate"] + anomalies["key_twice"] + anomalies["stored_twice"]
    return Result(
        "history_checker", sum(r.messages for r in reports), lost, doubled, "-",
        f"seed {seed}, {ctx.duration:g} s per level; {notes}", not anomalies,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.chaos.checker", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: random)")
    parser.add_argument(
        "--duration", type=float, default=20.0, help="seconds of operations per isolation level"
    )
    parser.add_argument("--isolation", action="append", choices=[SHORT[level] for level in LEVELS],
                        help="RC, RR or SER (repeatable; default: all three)")  # fmt: skip
    parser.add_argument("--weight", action="append", default=[], metavar="KIND=N",
                        help="draw KIND N times as often (repeatable; e.g. spark=10)")  # fmt: skip
    parser.add_argument("--big-spark-task", type=int, default=1_500, metavar="ROWS",
                        help="rows of the largest Spark writer task (default 1500)")  # fmt: skip
    args = parser.parse_args()
    weights = {}
    for item in args.weight:
        kind, _, n = item.partition("=")
        if kind not in KINDS or not n.isdigit() or int(n) < 1:
            parser.error(f"--weight {item}: expected KIND=N, KIND one of {', '.join(KINDS)}, N >= 1")
        weights[kind] = int(n)
    logging.disable(logging.ERROR)  # the faults make the clients' pools warn at every cut
    # SIGTERM (timeout, a cancelled job) unwinds like Ctrl-C: the workers and the server are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    levels = tuple(level for level in LEVELS if not args.isolation or SHORT[level] in args.isolation)
    reports = run_levels(seed, args.duration, levels, big_spark_task=args.big_spark_task, weights=weights)
    return 1 if any(r.anomalies for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
