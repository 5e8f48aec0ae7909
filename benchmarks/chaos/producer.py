"""A producer process for the chaos suite: business rows + messages in one transaction.

``python -m benchmarks.chaos.producer --url URL --prefix p --count 2000`` inserts
keys ``p000000..`` into ``chaos_orders`` and sends one ``work`` message per key
inside the same transaction (``outbox``), ``--batch`` keys per transaction.
``--rollback-rate`` rolls a share of the transactions back on purpose;
``--hold-ms`` keeps each transaction open a random time before commit, so a
``kill -9`` often lands mid-transaction; ``--retry`` retries a transaction that
failed on a connection error (a unique-key violation on retry means the
earlier commit did land).  ``--committed-log FILE`` appends each key to FILE once its
transaction's commit returned (the failover scenarios compare it with what the new
primary holds).  ``--mix`` sends, by key, a ``work`` message, a ``flaky`` one (fails once,
retried), a two-step pipeline or a message with an ``on_success`` callback, in turn.
Prints one JSON line of counts at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import dramatiq
from dramatiq import Message
from dramatiq.errors import BrokerConnectionError
from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError, IntegrityError

from dramatiq_pg_outbox import PostgresBroker, outbox

from .harness import INSERT_ORDERS, QUEUE, sqlalchemy_url, work_message


def mixed_message(i: int, key: str) -> Message[Any]:
    """The message of the ``i``-th key with ``--mix``: work, flaky, a pipeline, a callback."""
    kind = i % 4
    if kind == 0:
        return work_message(key)
    if kind == 1:
        return Message(queue_name=QUEUE, actor_name="flaky", args=(key,), kwargs={}, options={})
    if kind == 2:
        second = Message(queue_name=QUEUE, actor_name="step_two", args=(), kwargs={}, options={})
        return Message(
            queue_name=QUEUE, actor_name="step_one", args=(key,), kwargs={},
            options={"pipe_target": second.asdict()},
        )  # fmt: skip
    return Message(
        queue_name=QUEUE, actor_name="succeed", args=(key,), kwargs={}, options={"on_success": "on_done"}
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--rollback-rate", type=float, default=0.0)
    parser.add_argument("--hold-ms", type=float, default=0.0)
    parser.add_argument("--rate", type=float, default=0.0, help="transactions per second (0: unlimited)")
    parser.add_argument("--retry", action="store_true")
    parser.add_argument("--committed-log", type=Path, help="append each committed key to this file")
    parser.add_argument("--mix", action="store_true", help="work, flaky, pipelines and callbacks in turn")
    args = parser.parse_args()
    log = open(args.committed_log, "a", buffering=1) if args.committed_log else None

    broker = PostgresBroker(url=args.url)
    dramatiq.set_broker(broker)
    engine = create_engine(sqlalchemy_url(args.url), pool_pre_ping=True)
    stats = {"committed": 0, "rolled_back": 0, "errors": 0, "already_committed": 0, "outage_s": 0.0}
    failing_since: float | None = None
    started = time.monotonic()
    keys = [f"{args.prefix}{i:06d}" for i in range(args.start, args.start + args.count)]
    for n, start in enumerate(range(0, len(keys), args.batch)):
        if args.rate:
            time.sleep(max(0.0, started + n / args.rate - time.monotonic()))
        chunk = keys[start : start + args.batch]
        rollback = random.random() < args.rollback_rate
        retried = False
        while True:
            try:
                with engine.connect() as conn:
                    with outbox(conn, broker):
                        conn.execute(INSERT_ORDERS, {"keys": chunk})
                        for j, key in enumerate(chunk, start):
                            broker.enqueue(
                                mixed_message(args.start + j, key) if args.mix else work_message(key)
                            )
                    if args.hold_ms:
                        time.sleep(random.uniform(0, args.hold_ms) / 1000)
                    if rollback:
                        conn.rollback()
                        stats["rolled_back"] += len(chunk)
                    else:
                        conn.commit()
                        stats["committed"] += len(chunk)
                        if log is not None:
                            log.write("".join(f"{key}\n" for key in chunk))
                break
            except IntegrityError:
                if not retried:
                    raise
                stats["already_committed"] += len(chunk)
                stats["committed"] += len(chunk)
                if log is not None:
                    log.write("".join(f"{key}\n" for key in chunk))
                break
            except (DBAPIError, BrokerConnectionError):
                if not args.retry:
                    raise
                stats["errors"] += 1
                retried = True
                if failing_since is None:
                    failing_since = time.monotonic()
                time.sleep(0.1)
        if failing_since is not None:
            stats["outage_s"] = max(stats["outage_s"], time.monotonic() - failing_since)
            failing_since = None
    broker.close()
    if log is not None:
        log.close()
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
