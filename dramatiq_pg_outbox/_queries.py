"""Loader for ``queries.sql``: one query per ``-- name: <name> --`` header."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

from .names import quote_ident

_HEADER = re.compile(r"^-- name: ([a-z_]+) --$", re.MULTILINE)


@lru_cache(maxsize=1)
def raw_queries() -> dict[str, str]:
    """All queries of ``queries.sql`` by name, with ``{schema}`` not yet filled in."""
    text = resources.files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"queries.sql defines {name!r} twice")
        # Comments stay in the file for readers; they are dropped here so that
        # a placeholder-looking word in a comment never reaches psycopg.
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        queries[name] = "\n".join(lines).strip().rstrip(";")
    return queries


@lru_cache(maxsize=16)
def queries_for_schema(schema: str) -> dict[str, str]:
    """All queries with ``{schema}`` replaced by the quoted schema name.

    Raises:
      ValueError: If ``schema`` is not a valid schema name.
    """
    quoted = quote_ident(schema)
    return {name: sql.replace("{schema}", quoted) for name, sql in raw_queries().items()}
