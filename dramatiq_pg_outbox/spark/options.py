"""The string options of the Spark data sources, checked once: each error names its option."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..names import DEFAULT_SCHEMA, validate_schema_name
from ..urls import libpq_url

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
      ValueError: Naming the option: unknown, missing, a ``url`` that is not PostgreSQL,
        a bad ``schema`` (the URL's password is never in the message).
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
    try:
        conninfo = libpq_url(given["url"])
    except Exception as e:  # sqlalchemy's ArgumentError for what is no URL at all
        raise ValueError(f"option 'url' is not a PostgreSQL URL ({type(e).__name__})") from None
    schema = given.get("schema", DEFAULT_SCHEMA)
    try:
        validate_schema_name(schema)
    except ValueError as e:
        raise ValueError(f"option 'schema': {e}") from None
    return given, conninfo, schema


def connect(conninfo: str) -> Any:
    """A psycopg connection of the Spark integration (imported lazily: executors need it only here).

    Every connection is named ``dramatiq-pg-outbox-spark`` in ``pg_stat_activity``.

    Raises:
      psycopg.OperationalError: If the server cannot be reached.
    """
    from .._isolation import connect as connect_read_committed

    return connect_read_committed(conninfo, application_name="dramatiq-pg-outbox-spark")
