"""Run ``dramatiq`` CLI workers for the examples, as a supervisor would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def dramatiq_workers(
    module: str, processes: int, threads: int, log_path: Path, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m dramatiq <module> --processes N --threads M`` from the repository root.

    Output goes to ``log_path``.  At exit the CLI gets SIGTERM (graceful: unstarted
    messages go back to the queue) and, after 60 s, SIGKILL.
    """
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "dramatiq",
        module,
        "--processes",
        str(processes),
        "--threads",
        str(threads),
    ]
    with supervised(command, log_path, full_env, stop_timeout=60) as process:
        yield process


@contextmanager
def supervised(
    command: list[str], log_path: Path, env: Mapping[str, str] | None = None, *, stop_timeout: float = 30
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` from the repository root, output to ``log_path``; at exit SIGTERM it
    (graceful) and, after ``stop_timeout`` seconds, SIGKILL."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
