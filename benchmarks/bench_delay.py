"""Scenario 7 (delay): due time -> actor start of delayed messages and retries, idle worker.

Part 1, precision (ours, RedisBroker, RabbitmqBroker; 1 process x 8 threads, idle).
The parent sends K messages per case: ``send_with_options(delay=d)`` for d in
``DELAYS`` and a message whose actor raises ``Retry(delay=100)`` on its first
run.  Due times are spread ``SPACING_MS`` apart (plus jitter) in random case
order, so the worker is idle at each one; a message with delay d is sent at
its due time minus d.  The due time is ``time.time()`` just before ``send()``
plus d (for the retry: ``time.time()`` just before the actor raises, plus
100 ms), the same definition for every system; the broker's own due time
comes after it by the enqueue's latency, which counts against the broker.
The actor records ``time.time()`` when it starts; both clocks are this
machine's.  Every configuration runs with Dramatiq's default
``worker_timeout`` (1000 ms, what the ``dramatiq`` CLI uses) and with 100 ms
(Dramatiq's own tests and the other scenarios): Redis and RabbitMQ hold
delayed messages in the worker and only look at them when the delay queue's
consumer returns from ``__next__``, at most every ``worker_timeout``.

Part 2, many consumers (ours only): P processes x 1 thread, M delayed messages
with delays spread uniformly over ``HERD_SPREAD_MS``; every consumer counts
its claims and the claims that returned nothing (``_PostgresConsumer.claims``,
``.empty_claims``).  Polling alone would make one claim per consumer per
``max_fetch_interval``: that is printed beside it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any

from .bench_common import OURS, RABBITMQ, REDIS, Context, markdown_table, percentile
from .bench_systems import ACTOR, QUEUE, Shared, WorkerGroup, install, make_broker, record_start

#: Delays of part 1, in milliseconds.
DELAYS = (100, 500, 1_000, 5_000, 10_000)
#: Delay asked for by the actor's ``Retry``, in milliseconds.
RETRY_DELAY_MS = 100
#: Case labels, in table order.
CASES = (*(f"delay {d:,} ms" for d in DELAYS), f"Retry(delay={RETRY_DELAY_MS})")
#: Gap between two due times, in milliseconds (plus up to 10 ms of jitter).
SPACING_MS = 40
#: worker_timeout values of Dramatiq's Worker, in milliseconds.
WORKER_TIMEOUTS = (1_000, 100)
#: (label, system) of part 1.
SYSTEMS = (("ours", OURS), ("RedisBroker", REDIS), ("RabbitmqBroker", RABBITMQ))
#: Worker processes of part 2.
HERD_PROCESSES = (1, 4, 8)
#: Delays of part 2 are uniform in [HERD_MIN_MS, HERD_MIN_MS + HERD_SPREAD_MS], in milliseconds.
HERD_MIN_MS = 300
HERD_SPREAD_MS = 5_000
#: Seconds between the start of the workers and the sends of part 2: more than one
#: heartbeat_interval (5 s), so every consumer knows its peers (see _PostgresConsumer._mine).
HERD_SETTLE_S = 7.0


class DelayShared(Shared):
    """Shared memory of part 1 and 2: start times, raise times, claim counters."""

    def __init__(self, ctx: Any, slots: int) -> None:
        super().__init__(ctx, slots)
        #: time.time() at which the actor raised Retry, per message index (0: not yet).
        self.raised = ctx.Array("d", max(slots, 1), lock=False)
        #: Summed over our worker processes: claims, empty claims, seconds consumed (x1000).
        self.claims = ctx.Array("q", 3)


def delay_worker_process(
    system: str, url: str, threads: int, worker_timeout: int, shared: DelayShared, opts: dict[str, Any]
) -> None:
    """Body of one worker process: an actor that records its start (and raises Retry once if asked)."""
    logging.basicConfig(level=logging.ERROR)
    import dramatiq
    from dramatiq import Worker

    broker = make_broker(system, url, opts)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=QUEUE, actor_name=ACTOR, max_retries=3)
    def timed(i: int, retry: bool = False) -> None:
        if retry and shared.raised[i] == 0.0:
            shared.raised[i] = time.time()
            raise dramatiq.Retry(delay=RETRY_DELAY_MS)
        record_start(shared, i)

    broker.declare_queue(QUEUE)
    worker = Worker(broker, worker_threads=threads, worker_timeout=worker_timeout)
    shared.ready.release()
    shared.go.wait()
    started = time.monotonic()
    worker.start()
    shared.stop.wait()
    if system == OURS:
        consumers = list(broker.runtime.consumers.get(QUEUE, ()))
        with shared.claims.get_lock():
            # getattr: the scenario also measures versions of the broker without these counters.
            shared.claims[0] += sum(getattr(c, "claims", 0) for c in consumers)
            shared.claims[1] += sum(getattr(c, "empty_claims", 0) for c in consumers)
            shared.claims[2] += int((time.monotonic() - started) * 1000)
    worker.stop()
    broker.close()


class DelayWorkers(WorkerGroup):
    """WorkerGroup whose processes run :func:`delay_worker_process`."""

    def __init__(
        self, system: str, url: str, *, processes: int, threads: int, slots: int, worker_timeout: int
    ) -> None:
        self.ctx = mp.get_context("spawn")
        self.shared: DelayShared = DelayShared(self.ctx, slots)
        self.procs = [
            self.ctx.Process(
                target=delay_worker_process,
                args=(system, url, threads, worker_timeout, self.shared, {}),
                daemon=True,
            )
            for _ in range(processes)
        ]


def _url(ctx: Context, system: str, scenario: str) -> tuple[str, str]:
    dbname = f"bench_{scenario}_" + system.replace("-", "_").lower()
    return dbname, ctx.db_url(dbname)


def precision_once(ctx: Context, system: str, worker_timeout: int, k: int) -> dict[str, list[float]]:
    """Lateness (actor start - due time, ms) per case, one run of one system."""
    dbname, url = _url(ctx, system, "delay")
    install(system, ctx.admin_url, dbname, url)
    plan = [(case, delay) for case, delay in zip(CASES, (*DELAYS, 0), strict=True) for _ in range(k)]
    random.shuffle(plan)
    group = DelayWorkers(system, url, processes=1, threads=8, slots=len(plan), worker_timeout=worker_timeout)
    import dramatiq

    broker = make_broker(system, url, {})
    actor = dramatiq.actor(lambda i, retry=False: None, broker=broker, actor_name=ACTOR, queue_name=QUEUE)
    try:
        if system == OURS:
            # Open the producer's pool and check the schema now: our due time is the
            # database's now() at the INSERT, after any connection the send opens.
            broker.queue_size(QUEUE)
        group.start()
        group.go()
        time.sleep(1.5)  # the worker is up and idle
        first_due = time.time() + 0.5 + max(DELAYS) / 1000
        sends = []
        for j, (case, delay) in enumerate(plan):
            due = first_due + (j * SPACING_MS + random.uniform(0, 10)) / 1000
            lead = (delay or RETRY_DELAY_MS) / 1000
            sends.append((due - lead, j, case, delay))
        sends.sort()
        sent_at = [0.0] * len(plan)
        for at, j, _, delay in sends:
            pause = at - time.time()
            if pause > 0:
                time.sleep(pause)
            sent_at[j] = time.time()
            if delay:
                actor.send_with_options(args=(j,), delay=delay)
            else:
                actor.send_with_options(args=(j, True))
        if group.wait_for(len(plan), 30.0) is None:
            raise RuntimeError(f"only {group.done} of {len(plan)} messages ran within 30 s of the last send")
        started = list(group.shared.started)
        raised = list(group.shared.raised)
        lateness: dict[str, list[float]] = {}
        for j, (case, delay) in enumerate(plan):
            due = sent_at[j] + delay / 1000 if delay else raised[j] + RETRY_DELAY_MS / 1000
            lateness.setdefault(case, []).append((started[j] - due) * 1000)
        return lateness
    finally:
        broker.close()
        group.close()


def herd_once(ctx: Context, processes: int, m: int, settle_s: float = HERD_SETTLE_S) -> dict[str, Any]:
    """P idle worker processes of ours, M delayed messages: claims, empty claims, lateness.

    The messages are sent ``settle_s`` seconds after the workers started.
    """
    dbname, url = _url(ctx, OURS, "delay_herd")
    install(OURS, ctx.admin_url, dbname, url)
    group = DelayWorkers(OURS, url, processes=processes, threads=1, slots=m, worker_timeout=1_000)
    import dramatiq

    broker = make_broker(OURS, url, {})
    actor = dramatiq.actor(lambda i, retry=False: None, broker=broker, actor_name=ACTOR, queue_name=QUEUE)
    try:
        broker.queue_size(QUEUE)
        group.start()
        group.go()
        time.sleep(settle_s)
        delays = [HERD_MIN_MS + random.randrange(HERD_SPREAD_MS) for _ in range(m)]
        sent_at = []
        for j, delay in enumerate(delays):
            sent_at.append(time.time())
            actor.send_with_options(args=(j,), delay=delay)
        if group.wait_for(m, HERD_SPREAD_MS / 1000 + 30.0) is None:
            raise RuntimeError(f"only {group.done} of {m} messages ran")
        time.sleep(0.5)
        group.shared.stop.set()
        for p in group.procs:
            p.join(30)
        started = list(group.shared.started)
        late = [(started[j] - sent_at[j] - delays[j] / 1000) * 1000 for j in range(m)]
        claims, empty, consumed_ms = list(group.shared.claims)
        return {
            "claims": claims,
            "empty": empty,
            "poll_only_claims": consumed_ms / 1000,  # one claim per consumer per max_fetch_interval (1 s)
            "lateness": late,
        }
    finally:
        broker.close()
        group.close()


def _fmt(values: list[float] | None, p: float) -> str:
    return "-" if not values else f"{percentile(values, p):.1f}"


def _ratio(ours: list[float] | None, theirs: list[float] | None, p: float) -> str:
    if not ours or not theirs:
        return "-"
    b = percentile(theirs, p)
    return "-" if b <= 0 else f"{percentile(ours, p) / b:.2f}x"


def run(ctx: Context) -> dict[str, Any]:
    k = 1 if ctx.smoke else 10 if ctx.quick else 30
    # A smoke run: one worker_timeout and one herd, each as short as it can be.
    worker_timeouts = WORKER_TIMEOUTS[-1:] if ctx.smoke else WORKER_TIMEOUTS
    samples: dict[tuple[str, int, str], list[float]] = {}
    per_run: dict[str, list[dict[str, float]]] = {}
    errors: dict[str, list[str]] = {}
    loads: list[tuple[float, ...]] = []
    for run_no in range(ctx.runs):
        loads.append(os.getloadavg())
        for worker_timeout in worker_timeouts:
            for label, system in SYSTEMS:
                if system not in ctx.systems:
                    continue
                key = f"{label}, worker_timeout {worker_timeout}"
                try:
                    lateness = precision_once(ctx, system, worker_timeout, k)
                except Exception as e:
                    errors.setdefault(key, []).append(ctx.failed(f"delay run {run_no + 1} {key}", e))
                    continue
                summary = {}
                for case, values in lateness.items():
                    samples.setdefault((label, worker_timeout, case), []).extend(values)
                    summary[f"{case} p50"] = percentile(values, 50)
                    summary[f"{case} p99"] = percentile(values, 99)
                per_run.setdefault(key, []).append(summary)
                everything = [v for values in lateness.values() for v in values]
                print(
                    f"  delay run {run_no + 1} {key}: all cases p50 {percentile(everything, 50):.1f} ms, "
                    f"p99 {percentile(everything, 99):.1f} ms, max {max(everything):.1f} ms "
                    f"(load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    result: dict[str, Any] = {"k_per_case_per_run": k, "spacing_ms": SPACING_MS, "loadavg_at_start": loads}
    for worker_timeout in worker_timeouts:
        rows = []
        for case in CASES:
            ours = samples.get(("ours", worker_timeout, case))
            redis = samples.get(("RedisBroker", worker_timeout, case))
            rabbit = samples.get(("RabbitmqBroker", worker_timeout, case))
            rows.append(
                [
                    case,
                    str(len(ours or [])),
                    _fmt(ours, 50),
                    _fmt(ours, 99),
                    f"{max(ours):.1f}" if ours else "-",
                    _fmt(redis, 50),
                    _fmt(redis, 99),
                    _ratio(ours, redis, 99),
                    _fmt(rabbit, 50),
                    _fmt(rabbit, 99),
                    _ratio(ours, rabbit, 99),
                ]
            )
        header = ["case", "samples", "ours p50", "ours p99", "ours max", "Redis p50", "Redis p99"]
        header += ["ours/Redis p99", "RabbitMQ p50", "RabbitMQ p99", "ours/RabbitMQ p99"]
        result[f"table_worker_timeout_{worker_timeout}"] = markdown_table(header, rows)
    # Spread of the per-run p99 (all cases of a system pooled per run would hide the case).
    spread_rows = []
    for key, runs in per_run.items():
        for case in CASES:
            p99s = [r[f"{case} p99"] for r in runs if f"{case} p99" in r]
            if p99s:
                spread_rows.append(
                    [key, case, f"{statistics.median(p99s):.1f}", f"{min(p99s):.1f}-{max(p99s):.1f}"]
                )
    result["table_p99_per_run"] = markdown_table(
        ["system, worker_timeout", "case", "median of per-run p99 (ms)", "min-max"], spread_rows
    )
    if OURS in ctx.systems:
        m = 10 if ctx.smoke else 100 if ctx.quick else 300
        herd_rows = []
        herd_raw: dict[str, Any] = {}
        for processes in HERD_PROCESSES[:1] if ctx.smoke else HERD_PROCESSES:
            try:
                h = herd_once(ctx, processes, m, settle_s=1.0) if ctx.smoke else herd_once(ctx, processes, m)
            except Exception as e:
                error = ctx.failed(f"delay herd {processes} process(es)", e)
                herd_rows.append([str(processes), str(m), f"FAILED {error}"[:100], "", "", "", "", ""])
                continue
            herd_raw[str(processes)] = {k2: v for k2, v in h.items() if k2 != "lateness"}
            print(
                f"  delay herd {processes} process(es): {h['claims']} claims, {h['empty']} empty "
                f"(polling alone ~{h['poll_only_claims']:.0f}); lateness p50 "
                f"{percentile(h['lateness'], 50):.1f} ms p99 {percentile(h['lateness'], 99):.1f} ms",
                flush=True,
            )
            herd_rows.append(
                [
                    str(processes),
                    str(m),
                    str(h["claims"]),
                    str(h["empty"]),
                    f"{h['claims'] / m:.2f}",
                    f"{h['poll_only_claims']:.0f}",
                    f"{percentile(h['lateness'], 50):.1f}",
                    f"{percentile(h['lateness'], 99):.1f}",
                ]
            )
        result["herd_table"] = markdown_table(
            [
                "worker processes (x1 thread)",
                "delayed messages",
                "claims",
                "empty claims",
                "claims per message",
                "claims of polling alone (same time)",
                "p50 ms",
                "p99 ms",
            ],
            herd_rows,
        )
        result["herd_raw"] = herd_raw
    result["per_run"] = per_run
    result["errors"] = errors
    result["raw_percentiles"] = {
        f"{label} wt{wt} {case}": {p: percentile(v, p) for p in (50, 95, 99)}
        for (label, wt, case), v in samples.items()
    }
    return result
