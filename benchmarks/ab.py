"""Compare two revisions with interleaved runs: ``python -m benchmarks.ab BEFORE AFTER``.

Each round runs ``python -m benchmarks.run --runs 1`` (same scenarios and systems)
once on each revision, in a git worktree of its own, alternating which goes
first, so that a slow minute of the machine falls on both sides.  Every run
starts its own PostgreSQL server (as ``benchmarks.run`` does).  Printed: per
figure, the median and min-max of each side and whether each median falls
inside the other side's range (the check of a behaviour-preserving change).

Example (issue 18)::

    python -m benchmarks.ab 41136f0 HEAD --rounds 5 \\
        --scenarios drain,latency --systems dramatiq-pg-outbox,RedisBroker
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worktree(rev: str, base: str) -> str:
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    path = os.path.join(base, sha)
    command = ["git", "worktree", "add", "--detach", path, sha]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return path


def _figures(report: dict[str, Any]) -> dict[str, float]:
    """The figures of one ``benchmarks.run`` report: drain msgs/s and CPU per message per system
    and shape (CPU only from revisions whose drain measures it), latency p50/p99."""
    found: dict[str, float] = {}
    for key, value in report.get("drain", {}).get("raw", {}).items():
        if value["values"]:
            found[f"drain {key} (msgs/s)"] = statistics.median(value["values"])
    for key, values in report.get("drain", {}).get("raw_cpu", {}).items():
        if values:
            found[f"drain {key} (CPU ms/msg)"] = statistics.median(values)
    for label, percentiles in report.get("latency", {}).get("raw_percentiles", {}).items():
        for p in ("50", "99"):
            if p in percentiles:
                found[f"latency {label} p{p} (ms)"] = float(percentiles[p])
    return found


def _run(tree: str, out: str, passthrough: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    before = set(glob.glob(os.path.join(out, "*.json")))
    subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--runs", "1", "--out", out, *passthrough],
        cwd=tree,
        env=env,
        check=True,
    )
    (new,) = set(glob.glob(os.path.join(out, "*.json"))) - before
    with open(new) as f:
        return _figures(json.load(f))


def _shown(values: list[float]) -> str:
    return f"{statistics.median(values):,.2f} ({min(values):,.2f}-{max(values):,.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__)
    parser.add_argument("before", help="git revision measured as 'before'")
    parser.add_argument("after", help="git revision measured as 'after'")
    parser.add_argument("--rounds", type=int, default=5, help="runs per side (default 5)")
    parser.add_argument("--scenarios", default="drain,latency")
    parser.add_argument("--systems", default="dramatiq-pg-outbox,RedisBroker")
    parser.add_argument("--out", default="out/ab", help="directory of the JSON results")
    parser.add_argument("--add-to", default=None, help="an ab.json of the same revisions: add its rounds")
    args = parser.parse_args(argv)
    passthrough = ["--scenarios", args.scenarios, "--systems", args.systems]
    base = tempfile.mkdtemp(prefix="dpo-ab-")
    sides = {"before": _worktree(args.before, base), "after": _worktree(args.after, base)}
    results: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    if args.add_to:
        with open(args.add_to) as f:
            results = json.load(f)["results"]
    try:
        for round_no in range(args.rounds):
            order = ("before", "after") if round_no % 2 == 0 else ("after", "before")
            for side in order:
                print(f"# round {round_no + 1}/{args.rounds}: {side} ({args.__dict__[side]})", flush=True)
                out = os.path.abspath(os.path.join(args.out, side))
                for name, value in _run(sides[side], out, passthrough).items():
                    results[side].setdefault(name, []).append(value)
    finally:
        for tree in sides.values():
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
    rounds = len(next(iter(results["before"].values()), []))
    print(f"\n{rounds} interleaved rounds, before = {args.before}, after = {args.after}\n")
    print("| figure | before: median (min-max) | after: median (min-max) | medians in each other's range |")
    print("|---|---|---|---|")
    for name in sorted(set(results["before"]) & set(results["after"])):
        b, a = results["before"][name], results["after"][name]
        inside = min(a) <= statistics.median(b) <= max(a) and min(b) <= statistics.median(a) <= max(b)
        print(f"| {name} | {_shown(b)} | {_shown(a)} | {'yes' if inside else 'NO'} |")
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump({"before": args.before, "after": args.after, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
