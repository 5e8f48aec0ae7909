"""Where a drain's time goes: ``python -m benchmarks.profile_drain [--processes 1] [--n 40000]``.

One drain of ``--n`` no-op messages by our broker (``--processes`` x 8 threads) on a
private PostgreSQL server with ``pg_stat_statements`` (as ``benchmarks.run`` starts it),
while py-spy samples every worker process (``--no-py-spy`` to skip it).  Printed:

* CPU per message during the drain: the whole box (``/proc/stat``), the worker
  processes and the PostgreSQL server (``/proc/<pid>/stat`` of each), in ms;
* the statements by total server time (planning + execution, ``pg_stat_statements``):
  calls, plans (how many times the server planned it), rows per call, planning and execution
  ms per call, share of the total;
* the worker processes' Python functions by own and inclusive time, over the samples in which
  a thread was not waiting (``--gil``: only samples that held the GIL).

Issue 23 asks for these lines before and after each change (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

import psycopg

from .bench_common import OURS, busy_jiffies, cpu_ms_per_message, db_name, postgres_for_benchmarks
from .bench_systems import WorkerGroup, install, prefill


def _proc_jiffies(pids: list[int]) -> int:
    """user + system jiffies of the given processes (children not included)."""
    spent = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            spent += int(fields[11]) + int(fields[12])
        except (FileNotFoundError, ProcessLookupError):  # the process ended meanwhile (read fails)
            pass
    return spent


def _server_pids(url: str) -> list[int]:
    """The postmaster of the server at ``url`` (its postmaster.pid) and its children."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    with open(os.path.join(str(row[0]), "postmaster.pid")) as f:
        postmaster = int(f.readline())
    found = [postmaster]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if parent == postmaster:
            found.append(int(entry))
    return found


def _statements(url: str, dbname: str, total_messages: int) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT s.query, s.calls, s.plans, s.rows, s.total_plan_time, s.total_exec_time, s.wal_records, "
            "s.shared_blks_hit + s.shared_blks_read "
            "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            "WHERE d.datname = %s ORDER BY s.total_plan_time + s.total_exec_time DESC LIMIT 12",
            (dbname,),
        ).fetchall()
    grand = sum(plan + exec_ for _, _, _, _, plan, exec_, _, _ in rows) or 1.0
    with psycopg.connect(url, autocommit=True) as conn:
        tuples = conn.execute(
            "SELECT sum(n_tup_ins), sum(n_tup_upd), sum(n_tup_hot_upd), sum(n_tup_del) "
            "FROM pg_stat_user_tables WHERE schemaname = 'dramatiq' AND relname LIKE 'messages%%'"
        ).fetchone()
    lines = [
        "| statement | calls | plans | rows/call | plan ms/call | exec ms/call | share | server us/msg "
        "| WAL records/msg | blocks/call |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for query, calls, plans, nrows, plan, exec_, wal_records, blocks in rows:
        head = " ".join(query.split())[:70].replace("|", "\\|")
        lines.append(
            f"| `{head}` | {calls:,} | {plans:,} | {nrows / max(calls, 1):.1f} | "
            f"{plan / max(calls, 1):.3f} | "
            f"{exec_ / max(calls, 1):.3f} | {100 * (plan + exec_) / grand:.0f}% | "
            f"{1000 * (plan + exec_) / total_messages:.1f} | {wal_records / total_messages:.2f} "
            f"| {blocks / max(calls, 1):.0f} |"
        )
    if tuples is not None and all(x is not None for x in tuples):
        ins, upd, hot, dele = (int(x) for x in tuples)
        lines += [
            "",
            "| messages partitions, per message | inserted | updated | of which HOT | deleted |",
            "|---|---|---|---|---|",
            f"| | {ins / total_messages:.2f} | {upd / total_messages:.2f} | {hot / total_messages:.2f} "
            f"| {dele / total_messages:.2f} |",
        ]
    return lines


def _role(frames: list[str]) -> str:
    """Which thread of a worker process a py-spy stack belongs to."""
    if any("ConsumerThread.run" in f for f in frames):
        return "consumer thread"
    if any("WorkerThread.run" in f for f in frames):
        return "worker threads"
    if any("flusher.py" in f for f in frames):
        return "flush loop"
    return "other"


def _state(frames: list[str]) -> str:
    """What a sampled thread was doing: a database round trip, waiting, or running Python."""
    if any("Connection.wait" in f or "notifies" in f for f in frames):
        return "database round trip"
    leaf = frames[-1]
    if leaf.startswith(("Condition.wait", "Event.wait", "Lock.acquire")) or "sleep" in leaf:
        return "waiting"
    # The LISTEN thread's own line is its select() on the connection (py-spy shows no native
    # frame): counted as Python, it took about a quarter of the samples "not waiting".
    if leaf.startswith("_Listener.run_once"):
        return "waiting"
    return "Python"


def _thread_lines(files: list[str]) -> list[str]:
    """Per thread role, the share of its samples in each state (py-spy --threads --idle).

    Dramatiq runs a consumer thread per queue, and one for the queue's delay queue,
    mostly idle in a drain: per worker process, only the one that claimed most is counted.
    """
    per_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    seen: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    claimed: collections.Counter[str] = collections.Counter()
    for path in files:
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                frames = stack.split(";")
                if len(frames) < 2:
                    continue
                thread = path + frames[0]
                seen[thread][_role(frames)] += int(count)
                if any("_fetch" in frame for frame in frames):
                    claimed[thread] += int(count)
                per_thread[thread][_state(frames[1:])] += int(count)
    # A thread's role is what most of its stacks say (its first ones may predate its loop).
    roles = {t: max(c, key=lambda r: (r != "other", c[r])) for t, c in seen.items()}
    out = ["| thread | threads | database round trip | waiting | Python |", "|---|---|---|---|---|"]
    kinds = ("database round trip", "waiting", "Python")
    for role in ("consumer thread", "worker threads", "flush loop"):
        chosen = [t for t, r in roles.items() if r == role]
        if role == "consumer thread":
            busiest = {
                path: max((t for t in chosen if t.startswith(path)), key=lambda t: claimed[t])
                for path in files
            }
            chosen = list(busiest.values())
        states: collections.Counter[str] = collections.Counter()
        for thread in chosen:
            states.update(per_thread[thread])
        total = sum(states.values()) or 1
        shares = [f"{100 * states[k] / total:.0f}%" for k in kinds]
        out.append(f"| {role} | {len(chosen)} | " + " | ".join(shares) + " |")
    return out


def _py_spy_lines(files: list[str], top: int) -> list[str]:
    """The functions of the samples in which a thread was not waiting (own time, and inclusive)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    samples = 0
    for path in files:
        try:
            with open(path) as f:
                lines = f.readlines()
        except FileNotFoundError:
            continue
        for line in lines:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            count = int(count_text)
            frames = [frame for frame in stack.split(";") if frame and not frame.startswith("process ")]
            frames = [frame for frame in frames if not frame.startswith("thread ")]
            if not frames or _state(frames) == "waiting":
                continue
            samples += count
            own[frames[-1]] += count
            for frame in set(frames):
                inclusive[frame] += count
    out = ["| function (own time) | share of samples not waiting |", "|---|---|"]
    for frame, count in own.most_common(top):
        out.append(f"| `{frame[:110]}` | {100 * count / max(samples, 1):.1f}% |")
    out += ["", "| function (inclusive) | share of samples not waiting |", "|---|---|"]
    for frame, count in inclusive.most_common(top + 10):
        out.append(f"| `{frame[:110]}` | {100 * count / max(samples, 1):.1f}% |")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=40_000, help="messages drained (default 40,000)")
    parser.add_argument("--processes", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--threads", type=int, default=8, help="threads per process (default 8)")
    parser.add_argument("--no-py-spy", action="store_true", help="do not sample the workers")
    parser.add_argument("--gil", action="store_true", help="py-spy counts only samples holding the GIL")
    parser.add_argument("--top", type=int, default=15, help="functions listed (default 15)")
    parser.add_argument("--keep", default=None, help="directory to keep py-spy's raw stacks in")
    parser.add_argument("--opts", default="", help="broker options, k=v,k=v (ints), e.g. rotate_interval=0")
    args = parser.parse_args(argv)
    opts: dict[str, Any] = {}
    for item in filter(None, args.opts.split(",")):
        key, _, value = item.partition("=")
        opts[key] = int(value)
    spy = None if args.no_py_spy else shutil.which("py-spy")
    with postgres_for_benchmarks(None) as admin_url, tempfile.TemporaryDirectory() as tmp:
        dbname = db_name(OURS, "profile")
        url = admin_url.rsplit("/", 1)[0] + "/" + dbname
        install(OURS, admin_url, dbname, url)
        prefill(OURS, url, args.n)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("VACUUM ANALYZE")
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
            conn.execute("SELECT pg_reload_conf()")
        group = WorkerGroup(OURS, url, processes=args.processes, threads=args.threads, opts=opts)
        group.start()
        spies: list[subprocess.Popen[bytes]] = []
        files: list[str] = []
        try:
            if spy:
                for pid in group.pids():
                    path = os.path.join(args.keep or tmp, f"{pid}.txt")
                    command = [spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "100"]
                    command += ["--nonblocking", "--threads", "--idle", "-o", path]
                    if args.gil:
                        command.append("--gil")
                    quiet = subprocess.DEVNULL
                    spies.append(subprocess.Popen(command, stdout=quiet, stderr=quiet))
                    files.append(path)
                time.sleep(1.0)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT pg_stat_statements_reset()")
            server = _server_pids(url)
            busy0 = busy_jiffies()
            workers0 = _proc_jiffies(group.pids())
            server0 = _proc_jiffies(server)
            t0 = group.go()
            t1 = group.wait_for(args.n, 120.0)
            busy1 = busy_jiffies()
            workers1 = _proc_jiffies(group.pids())
            server1 = _proc_jiffies(list(set(server) | set(_server_pids(url))))
            statements = _statements(url, dbname, args.n)
        finally:
            for s in spies:
                s.send_signal(signal.SIGINT)
            for s in spies:
                s.wait(30)
            group.close()
        if t1 is None:
            raise SystemExit("the drain did not finish within 120 s")
        elapsed = t1 - t0
        shape = f"{args.processes} x {args.threads}"
        print(f"## Drain of {args.n:,} messages, {shape}: {args.n / elapsed:,.0f} msg/s")
        print()
        print("| CPU per message (ms) | whole box | worker processes | PostgreSQL |")
        print("|---|---|---|---|")
        ticks = (busy1 - busy0, workers1 - workers0, server1 - server0)
        cpu = [cpu_ms_per_message(t, args.n) for t in ticks]
        print("| | " + " | ".join(f"{x:.4f}" for x in cpu) + " |")
        print()
        print("\n".join(statements))
        if files:
            print()
            print("\n".join(_thread_lines(files)))
            print()
            print("\n".join(_py_spy_lines(files, args.top)))


if __name__ == "__main__":
    main()
