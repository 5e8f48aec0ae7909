"""Errors raised by dramatiq-pg-outbox, rooted in Dramatiq's error tree."""

from __future__ import annotations

import getpass
import os
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import psycopg_pool
from dramatiq.errors import BrokerError, ConnectionClosed, ConnectionFailed
from dramatiq.middleware import Interrupt
from psycopg.conninfo import conninfo_to_dict


class SchemaNotReady(BrokerError):
    """The broker's tables are missing or older than this version of the package needs.

    The message names the command that fixes it (``dramatiq-pg-outbox migrate``).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)  # type: ignore[no-untyped-call]


class OutboxError(BrokerError):
    """A transactional enqueue was used wrongly (for example, an ``AsyncSession`` in a sync ``with``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)  # type: ignore[no-untyped-call]


class Canceled(Interrupt):
    """An operator canceled the message this thread runs (``dramatiq-pg-outbox cancel``, the dashboard).

    Raised in the actor's thread the way Dramatiq's ``TimeLimit`` raises
    ``TimeLimitExceeded`` (an asynchronous exception, delivered when the thread
    next runs Python code: an actor blocked in a C call, such as a socket read, a
    query or ``time.sleep``, sees it once that call returns).  The delivery then
    ends in history as ``canceled``, with no retry and none of its follow-ups
    (callbacks, the pipeline's next step), whatever the ``Retries`` middleware
    decides; a result waiter gets it as the failure.  An actor declared with
    ``cancel="ask"`` is never interrupted: it calls
    :func:`~dramatiq_pg_outbox.is_canceled` and returns (or raises this) on its own.
    """


class MessageTooLarge(ValueError):
    """An encoded message is larger than the broker's ``max_message_bytes``.

    Raised by ``send()`` (inside ``outbox()`` too, before the commit: nothing of
    the message is written).  Its message is one line naming the actor, the
    size and the limit.

    Attributes:
      actor_name(str): The actor of the refused message.
      size(int): Its encoded size, in bytes.
      limit(int): The broker's ``max_message_bytes``.
    """

    def __init__(self, actor_name: str, size: int, limit: int) -> None:
        self.actor_name = actor_name
        self.size = size
        self.limit = limit
        super().__init__(
            f"message for actor {actor_name!r} is {size:,} bytes encoded, over the broker's "
            f"max_message_bytes={limit:,}: store large data elsewhere and send a reference "
            "(or raise the option; None disables the limit)"
        )


class ConnectionRejected(ConnectionFailed):
    """PostgreSQL refused the connection for a reason that waiting cannot fix.

    A wrong password, a missing role or database, no ``pg_hba.conf`` entry.
    Raised at once instead of after ``pool_timeout``; its message is one line
    naming the cause and what to check.  A subclass of Dramatiq's
    ``ConnectionFailed``, so code that handles connection errors still does.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)  # type: ignore[no-untyped-call]


#: Template of a PostgreSQL URL, for messages.
URL_SHAPE = "postgresql://USER:PASSWORD@HOST:PORT/DATABASE"


def rejection_reason(error: BaseException, *, server: str, user: str, dbname: str) -> str | None:
    """One line on why PostgreSQL refused a connection, if retrying cannot help; else None.

    psycopg reports connection failures without a SQLSTATE (libpq gets no
    error fields before the session exists), so this reads libpq's message:
    the server's ``FATAL`` text (``password authentication failed``, ``role
    "..." does not exist``, ``database "..." does not exist``, ``no pg_hba.conf
    entry``) or libpq's own ``no password supplied``.  Those are PostgreSQL's
    English messages: a server with another ``lc_messages`` yields None, and
    the caller keeps waiting as for any transient failure (refused
    connection, server starting, timeout), which is the safe side.

    Parameters:
      error(BaseException): The ``psycopg.OperationalError`` of the connection attempt.
      server(str): ``host:port`` as shown to the user.
      user(str): The user name of the attempt.
      dbname(str): The database name of the attempt.
    """
    text = str(error)
    where = f"PostgreSQL at {server}"
    if "password authentication failed" in text:
        return (
            f"{where} refused user {user!r}: password authentication failed. "
            "Check the user name and password in the URL"
        )
    if "no password supplied" in text:
        return (
            f"{where} wants a password for user {user!r} and the URL has none. Add it to the URL: {URL_SHAPE}"
        )
    if re.search(r'role ".*" does not exist', text):
        return (
            f"{where} refused user {user!r}: the role does not exist. Check the user name in the URL, "
            "or create the role (CREATE ROLE ... LOGIN PASSWORD ...)"
        )
    if re.search(r'database ".*" does not exist', text):
        return (
            f"{where} has no database {dbname!r}. Check the database name in the URL, "
            f"or create it (createdb {shlex.quote(str(dbname))})"
        )
    if "no pg_hba.conf entry" in text:
        return (
            f"{where} does not let user {user!r} connect to database {dbname!r} from this host "
            f"({libpq_detail(error)}). Check the URL, or ask the DBA to allow it in pg_hba.conf"
        )
    return None


def describe_rejection(error: BaseException, conninfo: str) -> str | None:
    """:func:`rejection_reason` for a failed connection to ``conninfo`` (libpq's defaults filled in)."""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        params = {}
    server = f"{params.get('host') or 'localhost'}:{params.get('port') or 5432}"
    user = str(params.get("user") or os.environ.get("PGUSER") or login_name())
    return rejection_reason(error, server=server, user=user, dbname=str(params.get("dbname") or user))


def login_name() -> str:
    """libpq's default user name: this process's login name."""
    try:
        return getpass.getuser()
    except Exception:
        return "(your login name)"


def libpq_detail(error: BaseException) -> str:
    """libpq's message on one line, without its ``connection to server at ... failed:`` prefixes."""
    text = str(error).removeprefix("connection failed: ")
    text = re.sub(r'connection to server (at "[^"]*"(, port \d+)?|on socket "[^"]*") failed: ', "", text)
    text = text.replace("FATAL:  ", "")
    return " ".join(text.split()).rstrip(".")


@contextmanager
def translate_errors() -> Iterator[None]:
    """Turn psycopg connection errors into Dramatiq's ``ConnectionClosed``/``ConnectionFailed``.

    Dramatiq's Worker restarts consumers, and retries acks, only for those
    errors (subclasses of ``BrokerConnectionError``).  Other database errors
    propagate unchanged.
    """
    try:
        yield
    except ConnectionRejected:
        raise
    except psycopg_pool.PoolTimeout as e:
        raise ConnectionFailed(f"could not get a PostgreSQL connection from the pool: {e}") from e
    except (psycopg.OperationalError, psycopg.InterfaceError) as e:
        raise ConnectionClosed(f"lost the PostgreSQL connection: {e}") from e
