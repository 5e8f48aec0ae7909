"""How times, ages and errors read, the same on the dashboard's pages and in the command's tables.

One helper per thing shown, used by both (JSON outputs keep ISO 8601 and seconds):

- :func:`format_time`: an instant, ``2026-11-27 11:46:43 UTC``;
- :func:`format_age`: a duration, ``0.4 s``, ``42 s``, ``5 min 03 s``, ``2 h 05 min``, ``3 d 04 h``
  (followed by ``ago`` or preceded by ``in`` where the page or the table says so);
- :func:`exception_line` and :func:`error_parts`: the line that says what failed, its type once.

At the bottom of the package: imports only the standard library.
"""

from __future__ import annotations

import datetime as dt
import decimal
import re


def format_time(value: dt.datetime | None) -> str:
    """An instant in UTC, to the second: ``2026-11-27 11:46:43 UTC``.

    Parameters:
      value(datetime|None): An aware datetime (a database ``timestamptz``); None for none.

    Returns:
      str: The time, or ``-`` for None.
    """
    if value is None:
        return "-"
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_age(seconds: float | decimal.Decimal | None) -> str:
    """A duration: ``0.4 s``, ``42 s``, ``5 min 03 s``, ``2 h 05 min``, ``3 d 04 h``.

    Parameters:
      seconds(float|Decimal|None): Seconds; a negative value counts as 0.

    Returns:
      str: The duration, or ``-`` for None.
    """
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.1f} s"
    whole = int(s)
    if whole < 60:
        return f"{whole} s"
    if whole < 3_600:
        return f"{whole // 60} min {whole % 60:02d} s"
    if whole < 86_400:
        return f"{whole // 3_600} h {whole % 3_600 // 60:02d} min"
    return f"{whole // 86_400} d {whole % 86_400 // 3_600:02d} h"


def exception_line(error_type: str | None, error: str | None) -> str:
    """The line that says what failed, its type once: ``KeyError: 'no such customer'``.

    For a stored traceback, its exception line (the last line naming
    ``error_type``, else its last unindented line); for any other error text
    (``MaxDeliveriesExceeded``, ``DecodeError``), the type and the text's first
    line, unless that line already starts with the type.

    Parameters:
      error_type(str|None): ``history.error_type``, the exception's class name.
      error(str|None): ``history.error``, a traceback or a message.

    Returns:
      str: One line.
    """
    lines = [line.rstrip() for line in (error or "").splitlines() if line.strip()]
    kind = error_type or ""
    named = _named(kind)
    if any(line.startswith("Traceback (most recent call last):") for line in lines):
        if named is not None:
            for line in reversed(lines):
                if named.match(line):
                    return line
        for line in reversed(lines):
            if not line[:1].isspace() and line != "[...]":
                return f"{kind}: {line}" if kind and not line.startswith(kind) else line
    if not lines:
        return kind
    first = lines[0].strip()
    if not kind or (named is not None and named.match(first)):
        return first
    return f"{kind}: {first}"


def error_parts(error_type: str | None, error: str | None) -> tuple[str, str]:
    """:func:`exception_line` cut after its type, for a page that sets the type apart.

    Parameters:
      error_type(str|None): ``history.error_type``.
      error(str|None): ``history.error`` (or its last line).

    Returns:
      tuple[str, str]: ``error_type`` (empty when the line does not start with it, maybe
      module-qualified) and the rest of the line after it (``: bad input``).
    """
    line = exception_line(error_type, error)
    named = _named(error_type or "")
    found = named.match(line) if named is not None else None
    if found is None:
        return "", line
    end = found.end() - (1 if found.group(0).endswith(":") else 0)
    return error_type or "", line[end:]


def _named(kind: str) -> re.Pattern[str] | None:
    """A line that starts with the type ``kind`` (maybe module-qualified), then ``:`` or its end."""
    return re.compile(rf"^(?:[\w.]+\.)?{re.escape(kind)}(?::|$)") if kind else None


__all__ = ["error_parts", "exception_line", "format_age", "format_time"]
