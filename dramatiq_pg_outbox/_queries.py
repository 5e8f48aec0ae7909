"""The one loader of the package's SQL: every statement lives in a ``.sql`` file.

Each file holds one query per ``-- name: <name> --`` header; ``queries.sql`` also
holds the shared conditions (``-- fragment: <name> --``, see :func:`fragments`).  Comment lines stay in
the file for readers and are dropped on loading (a placeholder-looking word in a
comment never reaches psycopg); the trailing ``;`` is dropped too.  ``{schema}`` is
replaced by the quoted schema name; a few statements name another identifier in
braces (``{channel}``, ``{partition}``, ``{table}``, ``{database}``), filled by
:func:`with_identifiers`.  Values are always psycopg named placeholders
(``%(name)s``) with explicit casts.

The files (the broker's :data:`SQL_FILES` share one namespace, a name defined twice
is refused; the dashboard's file is a namespace of its own):

- ``queries.sql``: enqueue, claim, flush, maintenance, results, periodic jobs.
- ``admin.sql``: the operator statements (CLI, partitions, metrics, migrations, test servers).
- ``relay.sql``, ``spark.sql``: the outbox relay, the Spark enqueue and analytics reads;
  ``spark_backlog.sql``: the Spark reader of the live messages.
- ``dashboard/queries.sql``: the dashboard's reads (migration 0003's views).

The layout follows procrastinate's ``queries.sql`` and its loader.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

from .names import quote_ident

STATEMENT_HEADER = re.compile(r"^-- (name|fragment): ([a-z_]+) --$", re.MULTILINE)

#: Most runs of a statement that runs again for the rows changed under it (a purge, a cancel:
#: a row the reclaimer moved between partitions while the statement waited on it).
CHANGED_ROWS_ROUNDS = 10

#: The broker's SQL files, relative to the package: one namespace.
SQL_FILES = ("queries.sql", "admin.sql", "relay.sql", "spark.sql", "spark_backlog.sql")
#: The dashboard's SQL file, relative to the package: a namespace of its own.
DASHBOARD_SQL = "dashboard/queries.sql"


def _parse(path: str) -> tuple[dict[str, str], dict[str, str]]:
    """(queries, fragments) of one ``.sql`` file, comments and the trailing ``;`` dropped."""
    text = resources.files(__package__).joinpath(path).read_text(encoding="utf-8")
    parts = STATEMENT_HEADER.split(text)
    # parts = [preamble, kind1, name1, body1, kind2, name2, body2, ...]
    found: dict[str, dict[str, str]] = {"name": {}, "fragment": {}}
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        if name in found["name"] or name in found["fragment"]:
            raise ValueError(f"{path} defines {name!r} twice")
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        found[kind][name] = "\n".join(lines).strip().rstrip(";")
    return found["name"], found["fragment"]


@lru_cache(maxsize=1)
def fragments() -> dict[str, str]:
    """The shared conditions of ``queries.sql`` (``-- fragment: <name> --``), by name.

    A query names one as ``{<name>}``: one rule written once, such as
    ``worker_alive`` (when a worker process counts as alive), used by the claim's
    ranking, the rescuer, the metrics and the dashboard.
    """
    return _parse("queries.sql")[1]


@lru_cache(maxsize=8)
def file_queries(path: str) -> dict[str, str]:
    """The queries of one ``.sql`` file of the package by name, ``{schema}`` not yet filled in.

    Fragments (:func:`fragments`) are filled in, in parentheses.

    Parameters:
      path(str): Relative to the package, e.g. ``"queries.sql"``.

    Raises:
      ValueError: If the file defines a name twice.
    """
    queries = _parse(path)[0]
    for name, sql in queries.items():
        for fragment, text in fragments().items():
            sql = sql.replace("{" + fragment + "}", "(" + text + ")")
        queries[name] = sql
    return queries


@lru_cache(maxsize=1)
def raw_queries() -> dict[str, str]:
    """Every query of :data:`SQL_FILES` by name, ``{schema}`` not yet filled in.

    Raises:
      ValueError: If a name is defined twice, in one file or across them.
    """
    queries: dict[str, str] = {}
    for path in SQL_FILES:
        for name, sql in file_queries(path).items():
            if name in queries:
                raise ValueError(f"{path} defines {name!r}, already defined in another .sql file")
            queries[name] = sql
    return queries


@lru_cache(maxsize=16)
def queries_for_schema(schema: str, path: str | None = None) -> dict[str, str]:
    """The queries with ``{schema}`` replaced by the quoted schema name.

    Parameters:
      schema(str): The schema of the tables.
      path(str | None): One file's namespace (:data:`DASHBOARD_SQL`); default: :data:`SQL_FILES`.

    Raises:
      ValueError: If ``schema`` is not a valid schema name.
    """
    quoted = quote_ident(schema)
    queries = raw_queries() if path is None else file_queries(path)
    return {name: sql.replace("{schema}", quoted) for name, sql in queries.items()}


def with_identifiers(query: str, **identifiers: str) -> str:
    """Fill the ``{name}`` placeholders of ``query`` with double-quoted identifiers.

    Unlike ``{schema}``, these are not validated as schema names (a channel name
    holds a dot); any ``"`` is doubled, as ``psycopg.sql.Identifier`` does.
    """
    for name, value in identifiers.items():
        query = query.replace("{" + name + "}", '"' + value.replace('"', '""') + '"')
    return query
