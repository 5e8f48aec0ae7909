"""``python -m benchmarks.chaos [--quick] [--scenarios 1,2,...] [--url ADMIN_URL] [--markdown FILE]``.

Starts a private PostgreSQL server (``ThrowawayPostgres``, so scenario 3 may
restart it) unless ``--url`` names an existing server, creates a database for
the run, and runs the scenarios one after the other with real ``dramatiq``
CLI worker processes under a supervisor.  Prints one line per scenario and a
table at the end; exits 1 if any scenario lost a message or broke its
expectation.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import secrets
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox import upgrade
from dramatiq_pg_outbox.testing import ThrowawayPostgres

from .checker import history_checker
from .failover import failover_asynchronous, failover_synchronous
from .harness import Db, Producer
from .pinned import pinned_horizon
from .scenarios import SCENARIOS, Context, Result

#: Scenarios 10 (about 30 minutes), 11 (``--duration`` seconds per isolation level, three levels)
#: and 13-14 (a primary failover, with servers of their own) run only when named:
#: ``--scenarios 10``, ``--scenarios 11 --duration 1800``, ``--scenarios 13,14``.
ALL_SCENARIOS = {
    **SCENARIOS,
    10: pinned_horizon,
    11: history_checker,
    13: failover_synchronous,
    14: failover_asynchronous,
}

HEADER = ("scenario", "messages", "lost", "duplicates", "recovery time", "notes")


@contextlib.contextmanager
def server(url: str | None) -> Iterator[tuple[str, ThrowawayPostgres | None]]:
    if url:
        yield url, None
        return
    with ThrowawayPostgres({"max_connections": 200}) as pg:
        yield pg.url, pg


def _notes(result: Result) -> str:
    return ("" if result.ok else "FAILED: ") + result.notes


def table(results: list[Result]) -> str:
    rows = [HEADER] + [
        (r.scenario, str(r.messages), str(r.lost), str(r.duplicates), r.recovery, _notes(r)) for r in results
    ]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("---" for _ in HEADER) + "|")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, fast liveness settings")
    parser.add_argument("--scenarios", default="1,2,3,4,5,6,7,8,9,12", help="comma-separated numbers")
    parser.add_argument("--url", help="admin URL of an existing server (scenario 3 is then skipped)")
    parser.add_argument("--markdown", type=Path, help="also write the results table to this file")
    parser.add_argument(
        "--duration", type=float, default=600.0, help="scenario 11: seconds of operations per isolation level"
    )
    parser.add_argument("--seed", type=int, help="scenario 11: the schedule's seed (default: random)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    chosen = [int(s) for s in args.scenarios.split(",") if s.strip()]
    logdir = Path(tempfile.mkdtemp(prefix="chaos-logs-"))
    print(f"worker logs: {logdir}", flush=True)
    results: list[Result] = []
    with server(args.url) as (admin_url, pg):
        name = f"chaos_{secrets.token_hex(4)}"
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        try:
            upgrade(url, schema="dramatiq")
            db = Db(url)
            for number in chosen:
                db.reset()
                producer = Producer(url)
                ctx = Context(
                    url=url, server=pg, logdir=logdir, quick=args.quick, db=db, producer=producer,
                    duration=args.duration, seed=args.seed,
                )  # fmt: skip
                started = time.monotonic()
                print(f"--- scenario {number}: {ALL_SCENARIOS[number].__name__}", flush=True)
                try:
                    result = ALL_SCENARIOS[number](ctx)
                except Exception as e:
                    traceback.print_exc()
                    result = Result(ALL_SCENARIOS[number].__name__, 0, -1, -1, "-", f"error: {e}", False)
                finally:
                    producer.close()
                results.append(result)
                print(
                    f"{result.scenario}: messages={result.messages} lost={result.lost} "
                    f"duplicates={result.duplicates} recovery={result.recovery} ok={result.ok} "
                    f"({time.monotonic() - started:.0f} s)\n    {result.notes}",
                    flush=True,
                )
            db.close()
        finally:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    command = "python -m benchmarks.chaos" + (" --quick" if args.quick else "")
    output = table(results)
    print(f"\n{command}\n\n{output}")
    if args.markdown:
        args.markdown.write_text(f"`{command}`\n\n{output}\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
