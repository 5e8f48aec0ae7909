"""A producer process for the chaos suite: business rows + messages in one transaction.

``python -m benchmarks.chaos.producer --url URL --prefix p --count 2000`` inserts
keys ``p000000..`` into ``chaos_orders`` and sends one ``work`` message per key
inside the same transaction (``outbox``), ``--batch`` keys per transaction.
``--rollback-rate`` rolls a share of the transactions back on purpose;
``--hold-ms`` keeps each transaction open a random time before commit, so a
``kill -9`` often lands mid-transaction; ``--retry`` retries a transaction that
failed on a connection error (a unique-key violation on retry means the
earlier commit did land).  Prints one JSON line of counts at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import dramatiq
from dramatiq.errors import BrokerConnectionError
from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError, IntegrityError

from dramatiq_pg_outbox import PostgresBroker, outbox

from .harness import INSERT_ORDERS, sqlalchemy_url, work_message


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
    args = parser.parse_args()

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
                        for key in chunk:
                            broker.enqueue(work_message(key))
                    if args.hold_ms:
                        time.sleep(random.uniform(0, args.hold_ms) / 1000)
                    if rollback:
                        conn.rollback()
                        stats["rolled_back"] += len(chunk)
                    else:
                        conn.commit()
                        stats["committed"] += len(chunk)
                break
            except IntegrityError:
                if not retried:
                    raise
                stats["already_committed"] += len(chunk)
                stats["committed"] += len(chunk)
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
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
