"""A real local SMTP server (aiosmtpd) that stores every email it receives.

Each received email becomes one row of a SQLite file (recipient, user id
header, Message-ID, receive time), committed before the server answers
``250``, so the count survives anything that happens to the workers.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from email import message_from_bytes
from pathlib import Path
from typing import Any

from aiosmtpd.controller import Controller

from .emails import USER_ID_HEADER

_SCHEMA = """
CREATE TABLE IF NOT EXISTS emails (
    id          INTEGER PRIMARY KEY,
    recipient   TEXT    NOT NULL,
    user_id     INTEGER,
    message_id  TEXT,
    received_at REAL    NOT NULL
)
"""


class MailStore:
    """The received emails, in a SQLite file shared by the server thread and readers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def add(self, recipient: str, user_id: int | None, message_id: str | None) -> None:
        """Store one received email (committed on return)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO emails (recipient, user_id, message_id, received_at) VALUES (?, ?, ?, ?)",
                (recipient, user_id, message_id, time.time()),
            )

    def count(self) -> int:
        """Number of emails received so far."""
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM emails").fetchone()[0])

    def user_ids(self) -> list[int | None]:
        """The user id of every received email, one entry per email."""
        with self._lock:
            return [row[0] for row in self._db.execute("SELECT user_id FROM emails")]

    def last_received_at(self) -> float | None:
        """Time (``time.time()``) the newest email arrived, or ``None``."""
        with self._lock:
            newest = self._db.execute("SELECT max(received_at) FROM emails").fetchone()[0]
        return float(newest) if newest is not None else None

    def close(self) -> None:
        """Close the SQLite connection."""
        with self._lock:
            self._db.close()


class StoringHandler:
    """aiosmtpd handler: parse each email and store it in a :class:`MailStore`."""

    def __init__(self, store: MailStore) -> None:
        self.store = store

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        """Store the email once per recipient, then accept it."""
        message = message_from_bytes(envelope.content)
        header = message.get(USER_ID_HEADER)
        user_id = int(header) if header and header.strip().isdigit() else None
        for recipient in envelope.rcpt_tos:
            self.store.add(recipient, user_id, message.get("Message-ID"))
        return "250 Message accepted for delivery"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SmtpServer:
    """An aiosmtpd server on ``127.0.0.1`` and a free port, storing into ``store_path``.

    Use as a context manager: the server runs in a background thread inside it.
    """

    def __init__(self, store_path: Path, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port(host)
        self.store = MailStore(store_path)
        self._controller = Controller(StoringHandler(self.store), hostname=host, port=self.port)

    def __enter__(self) -> SmtpServer:
        self._controller.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._controller.stop()
        self.store.close()
