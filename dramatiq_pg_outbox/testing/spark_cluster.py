"""A Spark standalone cluster on this machine, for tests, examples and benchmarks.

A master and ``workers`` worker processes started from the pyspark distribution
(``bin/spark-class org.apache.spark.deploy.master.Master`` and ``...worker.Worker``),
all bound to 127.0.0.1 on free ports, each in its own process group.  Applications
connect with ``master_url`` (``spark://127.0.0.1:<port>``): their executors are
separate JVMs, started by the workers, with their own Python workers, as on a real
cluster.  Nothing here is needed in production.

Example:

    >>> with SparkStandaloneCluster(workers=2, cores=1, memory="1g") as cluster:  # doctest: +SKIP
    ...     spark = cluster_session(cluster.master_url)

Every process is stopped on exit (SIGTERM to its process group, SIGKILL after
``stop_timeout`` seconds): the executors and their Python workers belong to their
worker's group, so no JVM is left behind.  The logs (``master.log``,
``worker-<n>.log``) and the workers' directories (``work-<n>/<app>/<executor>/stderr``,
the executors' logs) are under ``log_dir``, kept after the stop when it was given.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from .binaries import free_port

#: Longest wait for the master to answer and every worker to register, in seconds.
START_TIMEOUT_S = 120.0
#: Environment variables a cluster process must not inherit: the test suite's per-test marker
#: (a session-wide cluster would be killed at the end of the first test that started it).
_NOT_INHERITED = ("DPO_TEST_MARK",)


def spark_home() -> Path:
    """The pyspark distribution's directory (it holds ``bin/spark-class`` and ``jars/``).

    Raises:
      RuntimeError: If pyspark is not installed (``pip install 'dramatiq-pg-outbox[spark]'``).
    """
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise RuntimeError("pyspark is not installed: pip install 'dramatiq-pg-outbox[spark]'")
    return Path(spec.origin).parent


class SparkStandaloneCluster:
    """A master and ``workers`` worker processes of Spark's standalone cluster manager.

    Parameters:
      workers(int): Worker processes (each runs the executors of every application). Default 2.
      cores(int): Cores each worker offers. Default 1.
      memory(str): Memory each worker offers to executors, in Spark's notation. Default ``"1g"``.
      log_dir(pathlib.Path|str|None): Where the logs and work directories go. Default: a
        temporary directory, removed at the stop.
      stop_timeout(float): Seconds a process has to stop after SIGTERM before SIGKILL. Default 10.

    Attributes:
      master_url(str): ``spark://127.0.0.1:<port>``, once started.
      web_url(str): The master's web UI, ``http://127.0.0.1:<port>`` (``/json/`` is its state).

    Raises:
      ValueError: For fewer than one worker or core.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        cores: int = 1,
        memory: str = "1g",
        log_dir: Path | str | None = None,
        stop_timeout: float = 10.0,
    ) -> None:
        if workers < 1 or cores < 1:
            raise ValueError(f"a cluster needs one worker and one core at least, not {workers}, {cores}")
        self.workers, self.cores, self.memory = workers, cores, memory
        self.stop_timeout = stop_timeout
        self._keep_logs = log_dir is not None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="dpo-spark-"))
        self.master_url = ""
        self.web_url = ""
        self._processes: list[subprocess.Popen[bytes]] = []
        self._names: list[str] = []

    def __enter__(self) -> SparkStandaloneCluster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT_S) -> SparkStandaloneCluster:
        """Start the master and the workers; return once every worker has registered.

        Raises:
          RuntimeError: If a process exits or the workers do not register within ``timeout``
            seconds (the message ends with the tail of the logs); whatever started is stopped.
        """
        port, ui_port = free_port(), free_port()
        self.master_url, self.web_url = f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._spawn("master", [
                "org.apache.spark.deploy.master.Master",
                "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui_port),
            ])  # fmt: skip
            deadline = time.monotonic() + timeout
            self._wait(lambda state: state is not None, deadline, "the master to answer")
            for n in range(1, self.workers + 1):
                work = self.log_dir / f"work-{n}"
                work.mkdir(exist_ok=True)
                self._spawn(f"worker-{n}", [
                    "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                    "--cores", str(self.cores), "--memory", self.memory,
                    "--webui-port", str(free_port()), "--work-dir", str(work), self.master_url,
                ])  # fmt: skip
            self._wait(
                lambda state: state is not None and state.get("aliveworkers") == self.workers,
                deadline,
                f"{self.workers} workers to register",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def state(self) -> dict[str, Any] | None:
        """The master's state (its web UI's ``/json/``), or None while it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.web_url}/json/", timeout=2) as response:
                state: dict[str, Any] = json.load(response)
                return state
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        """Stop every process (workers first, with their executors), then any process still working
        in ``log_dir``; idempotent."""
        for process in reversed(self._processes):
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for process in reversed(self._processes):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The group too: an executor or a Python worker may outlive its JVM for a moment.
            _signal_group(process, signal.SIGKILL)
            process.wait()
        self._processes.clear()
        self._names.clear()
        for pid in self.running() if self.log_dir.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # A killed process is gone once the kernel has torn it down: wait for it, briefly.
        deadline = time.monotonic() + 5
        while self.log_dir.exists() and self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def running(self) -> list[int]:
        """PIDs of the live processes of this cluster: those working in ``log_dir`` (the master,
        the workers, their executors and the executors' Python workers)."""
        root = self.log_dir.resolve()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cwd = Path(os.readlink(entry / "cwd"))
                except OSError:  # gone meanwhile, or not ours to read
                    continue
                if cwd == root or root in cwd.parents:
                    found.append(int(entry.name))
        return found

    def logs(self) -> str:
        """Every log of the cluster (master, workers, executors' stdout and stderr), concatenated."""
        paths = sorted(p for p in self.log_dir.rglob("*") if p.is_file() and p.suffix != ".jar")
        return "\n".join(p.read_text(errors="replace") for p in paths)

    def _spawn(self, name: str, arguments: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        home = spark_home()
        env.update(SPARK_HOME=str(home), SPARK_LOCAL_IP="127.0.0.1",
                   # No REST submission server (it would take the fixed port 6066).
                   SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")  # fmt: skip
        self._names.append(name)
        with (self.log_dir / f"{name}.log").open("wb") as log:
            self._processes.append(
                subprocess.Popen(
                    [str(home / "bin" / "spark-class"), *arguments],
                    cwd=self.log_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def _wait(self, ready: Any, deadline: float, what: str) -> None:
        while not ready(self.state()):
            exited = [n for n, p in zip(self._names, self._processes, strict=True) if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                reason = f"{exited[0]} exited" if exited else "timed out"
                raise RuntimeError(f"Spark standalone cluster: {reason} waiting for {what}:\n{self._tail()}")
            time.sleep(0.2)

    def _tail(self, lines: int = 20) -> str:
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
            for p in sorted(self.log_dir.glob("*.log"))
        )


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
