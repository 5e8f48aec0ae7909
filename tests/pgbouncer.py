"""A real PgBouncer, in transaction pooling mode unless told otherwise, started by the tests (``PgBouncer``).

Debian's ``pgbouncer`` package (1.18 on Debian 12); the tests that need it skip with
``PGBOUNCER_MISSING`` where the binary is absent.  Each instance writes its own
``pgbouncer.ini`` and ``userlist.txt`` into a temporary directory, listens on a free
127.0.0.1 port, runs in the foreground as a child of the test process (as ``nobody``
when the tests run as root: PgBouncer refuses to run as root) and is stopped, and its
directory removed, when the ``with`` block ends.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

from dramatiq_pg_outbox.testing import free_port

from .helpers import TEST_MARK, wait_for

#: Skip reason where the binary is missing (Debian and Ubuntu put it in /usr/sbin).
PGBOUNCER_MISSING = "pgbouncer is not installed: apt-get install -y pgbouncer"

#: Longest wait for PgBouncer to accept connections, in seconds.
START_TIMEOUT_S = 10


def pgbouncer_binary() -> str | None:
    """The ``pgbouncer`` program, also when /usr/sbin is not on PATH."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


class PgBouncer:
    """PgBouncer in front of the server of ``upstream_url``, ``pool_mode = transaction``.

    Parameters:
      upstream_url(str): A libpq URL of the server (its host, port, user, password, database).
      databases(dict[str, int]): Database alias -> most server connections for it (``pool_size``);
        every alias points at the database of ``upstream_url``.
      settings(dict[str, str|int]): More ``[pgbouncer]`` settings (they win over the defaults).
      pool_modes(dict[str, str]): Database alias -> its own ``pool_mode`` (``session``,
        ``transaction``, ``statement``); the other aliases use the ``[pgbouncer]`` one.
    """

    def __init__(
        self,
        upstream_url: str,
        databases: dict[str, int],
        settings: dict[str, str | int] | None = None,
        pool_modes: dict[str, str] | None = None,
    ) -> None:
        binary = pgbouncer_binary()
        if binary is None:
            raise RuntimeError(PGBOUNCER_MISSING)
        self.binary = binary
        self.upstream = conninfo_to_dict(upstream_url)
        self.databases = databases
        self.settings = settings or {}
        self.pool_modes = pool_modes or {}
        self.port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def user(self) -> str:
        return str(self.upstream.get("user") or "postgres")

    def url(self, alias: str) -> str:
        """URL of database ``alias`` through PgBouncer (the upstream password, if any, is not needed)."""
        return f"postgresql://{quote(self.user, safe='')}@127.0.0.1:{self.port}/{quote(alias, safe='')}"

    def admin_url(self) -> str:
        """URL of PgBouncer's admin console (``SHOW POOLS``, ``SHOW SERVERS``...)."""
        return self.url("pgbouncer")

    def __enter__(self) -> PgBouncer:
        self.dir = Path(tempfile.mkdtemp(prefix="dpo-pgbouncer-"))
        self.dir.chmod(0o755)  # read by the unprivileged user PgBouncer runs as
        try:
            for attempt in range(3):
                self.port = free_port()
                if self._start():
                    return self
                if attempt == 2 or "Address already in use" not in self.log():
                    raise RuntimeError(f"PgBouncer did not start:\n{self.log()}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def log(self) -> str:
        assert self.dir is not None
        try:
            return (self.dir / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop PgBouncer at once (SIGTERM: immediate shutdown, clients are cut)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def _start(self) -> bool:
        assert self.dir is not None
        host = str(self.upstream.get("host") or "127.0.0.1")
        server = f"host={host} port={self.upstream.get('port') or 5432} user={self.user}"
        if self.upstream.get("password"):
            server += f" password={self.upstream['password']}"
        dbname = self.upstream.get("dbname") or self.user
        lines = ["[databases]"]
        for alias, size in self.databases.items():
            mode = f" pool_mode={self.pool_modes[alias]}" if alias in self.pool_modes else ""
            lines.append(f"{alias} = {server} dbname={dbname} pool_size={size}{mode}")
        settings: dict[str, str | int] = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "pool_mode": "transaction",
            "auth_type": "trust",
            "auth_file": str(self.dir / "userlist.txt"),
            "admin_users": self.user,
            "max_client_conn": 500,
            "default_pool_size": 4,
            # A test waiting for a server connection fails in seconds, not after the default 120 s.
            "query_wait_timeout": 30,
            "pidfile": "",
            "logfile": "",
            **self.settings,
        }
        lines += ["[pgbouncer]"] + [f"{key} = {value}" for key, value in settings.items()]
        ini = self.dir / "pgbouncer.ini"
        ini.write_text("\n".join(lines) + "\n")
        userlist = self.dir / "userlist.txt"
        userlist.write_text(f'"{self.user}" ""\n')
        for path in (ini, userlist):
            path.chmod(0o644)  # the upstream password, if any: a throwaway test server's
        args = [self.binary]
        if os.geteuid() == 0:
            args += ["-u", pwd.getpwnam("nobody").pw_name]
        args.append(str(ini))
        # Not marked as the current test's process: a session's PgBouncer outlives the test that
        # started it (conftest.reap_test_processes); the session's mark still reaps it at the end.
        env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != TEST_MARK}
        with open(self.dir / "pgbouncer.log", "wb") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=self.dir
            )
        proc = self.proc
        try:
            wait_for(
                lambda: proc.poll() is not None or self._listening(),
                START_TIMEOUT_S,
                "PgBouncer to listen",
                0.02,
            )
        except AssertionError:
            self.stop()
            raise RuntimeError(
                f"PgBouncer did not listen within {START_TIMEOUT_S} s:\n{self.log()}"
            ) from None
        if proc.poll() is not None:
            self.proc = None
            return False
        return True

    def _listening(self) -> bool:
        """Whether PgBouncer accepts connections on its port."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False
