"""What every store shares: the schema's statements filled in once, and typed rows by column name."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from psycopg.rows import RowFactory

from .._queries import queries_for_schema

T = TypeVar("T", bound=tuple[Any, ...])


class SchemaStore:
    """The statements of the broker's ``.sql`` files on one schema: the base of every store.

    Parameters:
      schema(str): The schema of the broker's tables.

    Raises:
      ValueError: If ``schema`` is not a valid schema name.
    """

    def __init__(self, schema: str) -> None:
        self.schema = schema
        #: Every statement by name, ``{schema}`` filled in (``_queries.queries_for_schema``).
        self.queries = queries_for_schema(schema)


def named_rows(cls: type[T]) -> RowFactory[T]:
    """A psycopg row factory that makes each row a ``cls``, a ``NamedTuple`` of the statement's columns.

    ``tuple.__new__(cls, values)`` through ``functools.partial``: one C call per row, as
    cheap as psycopg's default tuples (``namedtuple_row`` and ``class_row`` call a
    Python function per row).  The statement's column names must be the fields of
    ``cls``, in order: checked once per statement run (a few C calls), so that a
    column added or moved in a ``.sql`` file fails loudly instead of shifting values.

    Raises:
      TypeError: (when the statement runs) If its columns are not the fields of ``cls``.
    """
    make = functools.partial(tuple.__new__, cls)
    fields = tuple(name.encode() for name in cls._fields)  # type: ignore[attr-defined]

    def factory(cursor: Any) -> Callable[[Sequence[Any]], T]:
        result = cursor.pgresult
        if result is not None and result.nfields:
            columns = tuple(result.fname(i) for i in range(result.nfields))
            if columns != fields:
                shown = [c.decode() for c in columns]
                raise TypeError(f"the statement returns the columns {shown}, not those of {cls.__name__}")
        return make

    return factory
