"""The string options of the Spark data sources, checked once: each error names its option."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..names import DEFAULT_SCHEMA, validate_schema_name
from ..urls import URLError, jdbc_url_error, libpq_url, mask_password

#: Options Spark passes to a data source on its own account (lower case).
SPARK_OWN = frozenset({"path", "checkpointlocation"})


def given_options(
    options: Mapping[str, str], source: str, known: Sequence[str], required: Sequence[str]
) -> tuple[dict[str, str], str, str]:
    """(the options by lower-case name, the libpq URL of ``url``, the ``schema``).

    Parameters:
      options: What Spark passed (its own, :data:`SPARK_OWN`, are dropped).
      source(str): The format's name, for the messages.
      known: Every option the source reads; any other is refused (a typo would be ignored).
      required: The options without a default.

    Raises:
      ValueError: Naming the option: unknown, missing, a ``url`` that is not PostgreSQL
        (a JDBC one: how to write it), a bad ``schema`` (the URL's password is never in the
        message).
    """
    given = {str(k).lower(): str(v) for k, v in options.items() if str(k).lower() not in SPARK_OWN}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} of format({source!r}); its options: {list(known)}")
    missing = [name for name in required if not given.get(name)]
    if missing:
        raise ValueError(
            f"format({source!r}) needs the option(s) {missing}, e.g. .option({missing[0]!r}, ...)"
        )
    conninfo = url_option(given, "url")
    schema = given.get("schema", DEFAULT_SCHEMA)
    try:
        validate_schema_name(schema)
    except ValueError as e:
        raise ValueError(f"option 'schema': {e}") from None
    return given, conninfo, schema


def url_option(given: Mapping[str, str], name: str) -> str:
    """The libpq URL of the URL option ``name`` (``url``, ``read_url``) of ``given``.

    Raises:
      ValueError: Naming the option: a JDBC URL (how to write it), or not a PostgreSQL URL.
    """
    jdbc = jdbc_url_error(given[name])
    if jdbc is not None:
        raise ValueError(f"option {name!r}: {jdbc}")
    try:
        return libpq_url(given[name])
    except URLError as e:  # a malformed host list: the message says what is wrong, without a password
        raise ValueError(f"option {name!r}: {e}") from None
    except Exception as e:  # sqlalchemy's ArgumentError for what is no URL at all
        raise ValueError(f"option {name!r} is not a PostgreSQL URL ({type(e).__name__})") from None


def connect(conninfo: str, **kwargs: Any) -> Any:
    """A psycopg connection of the Spark integration (imported lazily: executors need it only here).

    Every connection is named ``dramatiq-pg-outbox-spark`` in ``pg_stat_activity``; ``kwargs``
    go to ``psycopg.connect`` (``connect_timeout=``, ``autocommit=``).

    Raises:
      psycopg.OperationalError: If the server cannot be reached.
    """
    from .._isolation import connect as connect_read_committed

    return connect_read_committed(conninfo, application_name="dramatiq-pg-outbox-spark", **kwargs)


#: Seconds the driver's check waits for the server, unless the URL sets ``connect_timeout``.
CHECK_TIMEOUT = 5


def check_database(
    url: str, conninfo: str, schema: str, *, skip: str, actor: tuple[str, str, str] | None = None
) -> None:
    """On the driver, before any task: the database answers and ``schema`` is migrated.

    One short connection (:data:`CHECK_TIMEOUT` seconds to connect, unless the URL sets
    ``connect_timeout``), the package's schema check
    (:func:`~dramatiq_pg_outbox.migrations.check_schema`), closed at once.  Each error is
    one line naming the fix, without the password: the tasks would otherwise each fail
    on the same cause, retried ``spark.task.maxFailures`` times.

    Parameters:
      url(str): The URL as the user gave it (shown masked, and in the ``migrate`` command
        when it has no password).
      conninfo(str): Its libpq URL.
      schema(str): The broker's schema.
      skip(str): How the caller turns the check off, for the message of an unreachable
        server (``.option("check_database", "false")``).
      actor: ``(actor name, queue name, how to turn the check off)`` to check too that a live
        worker of the queue declares the actor (:func:`check_actor`); None (default) skips it.

    Raises:
      dramatiq_pg_outbox.errors.ConnectionRejected: PostgreSQL refused the connection: no such
        database or role, a wrong password, no ``pg_hba.conf`` entry.
      dramatiq.errors.ConnectionFailed: The server cannot be reached (refused, unknown
        host, no answer within the timeout).
      dramatiq_pg_outbox.SchemaNotReady: The tables are missing or older than this version
        needs; the message names the ``dramatiq-pg-outbox migrate`` command.
      UnknownActor: (``actor``) no live worker of the queue declares the actor.
    """
    import shlex

    import psycopg
    from dramatiq.errors import ConnectionFailed
    from psycopg.conninfo import conninfo_to_dict

    from ..errors import ConnectionRejected, describe_rejection, libpq_detail
    from ..migrations import check_schema

    shown = mask_password(url)
    params = conninfo_to_dict(conninfo)
    timeout = {} if params.get("connect_timeout") else {"connect_timeout": CHECK_TIMEOUT}
    try:
        conn = connect(conninfo, autocommit=True, **timeout)
    except psycopg.OperationalError as e:
        reason = describe_rejection(e, conninfo)
        if reason is not None:
            raise ConnectionRejected(reason) from None
        server = f"{params.get('host') or 'localhost'}:{params.get('port') or 5432}"
        text = str(e)
        if "Connection refused" in text or "No such file or directory" in text:
            why = "connection refused"
        elif "resolve host" in text or "translate host name" in text:
            why = "unknown host"
        elif "timeout expired" in text:
            why = f"no answer within {params.get('connect_timeout') or CHECK_TIMEOUT} s"
        else:
            why = libpq_detail(e)
        raise ConnectionFailed(
            f"cannot connect to PostgreSQL at {server} ({shown}): {why}. Check that PostgreSQL runs "
            f"and the host and port of the URL; if only the executors can reach it, skip this "
            f"check with {skip}"
        ) from None
    with conn:
        # The migrate command shows the URL when it has no secret, else "$DATABASE_URL".
        check_schema(conn, schema, url=shown, fix_url=shlex.quote(url) if shown == url else None)
        if actor is not None:
            check_actor(conn, schema, *actor)


class UnknownActor(ValueError):
    """A write's actor is declared by no live worker of its queue (the ``check_actor`` option)."""


def check_actor(conn: Any, schema: str, actor_name: str, queue_name: str, skip: str) -> None:
    """Refuse a write whose messages no live worker would run (the opt-in ``check_actor``).

    The worker processes record the queues they consume and the actors their broker declares
    with each heartbeat (``workers``, migration 0020); a process counts as live if it
    heartbeated within the default ``heartbeat_timeout``
    (:data:`~dramatiq_pg_outbox.options.HEARTBEAT_TIMEOUT_MS`).  The write passes when one live
    process consumes ``queue_name`` (a delay queue ``X.DQ`` counts as ``X``) and declares
    ``actor_name``: without the check, a typo in the actor's name dead-letters every message
    as ``ActorNotFound``, and a queue that no worker consumes keeps its messages pending.

    Parameters:
      conn: A psycopg connection to the database.
      schema(str): The broker's schema.
      actor_name(str): The actor the messages name.
      queue_name(str): Their queue.
      skip(str): How the caller turns the check off, for the messages.

    Raises:
      UnknownActor: One line: no live worker at all; none consuming the queue (the queues
        consumed); or none of the queue's declaring the actor (the actors they declare, and the
        closest name if one is close).
    """
    import difflib

    from dramatiq.common import q_name

    from ..options import HEARTBEAT_TIMEOUT_MS
    from ..store.spark import SparkStore

    live = SparkStore(schema).live_workers(conn, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    seconds = HEARTBEAT_TIMEOUT_MS // 1000
    if not live:
        raise UnknownActor(
            f"no live worker: no worker process heartbeated in the last {seconds} s, so nothing would "
            f"run actor {actor_name!r}; start the workers first, or skip this check with {skip}"
        )
    consumers = [actors for queues, actors in live if queue_name in {q_name(q) for q in queues}]
    if not consumers:
        consumed = sorted({q_name(q) for queues, _ in live for q in queues})
        raise UnknownActor(
            f"no live worker consumes queue {queue_name!r} (live workers consume {consumed}): its "
            f"messages would wait; check the option 'queue', or skip this check with {skip}"
        )
    declared = sorted({a for actors in consumers for a in actors})
    if actor_name not in declared:
        close = difflib.get_close_matches(actor_name, declared, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        shown = declared if len(declared) <= 20 else [*declared[:20], "..."]
        raise UnknownActor(
            f"no live worker of queue {queue_name!r} declares actor {actor_name!r} (they declare "
            f"{shown}): each message would be dead-lettered as ActorNotFound; {hint}check the actor's "
            f"name, or skip this check with {skip}"
        )
