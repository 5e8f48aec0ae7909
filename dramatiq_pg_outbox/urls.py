"""Database URLs as they may be shown: in a repr, a log line or an error message.

Every place the package prints a URL or a libpq conninfo string goes through
:func:`mask_password` (or :func:`safe_url`), which hides the password in the
user-info part *and* in ``password``/``sslpassword`` query parameters
(SQLAlchemy's ``render_as_string(hide_password=True)`` hides only the former).
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

if TYPE_CHECKING:
    # SQLAlchemy is imported by the functions that parse a URL: a Spark task's Python
    # worker imports this module (masking a URL) without needing it.
    from sqlalchemy.engine import URL

#: libpq parameters whose values are secrets (``sslpassword`` unlocks the client key).
SECRET_PARAMETERS = frozenset({"password", "sslpassword"})
#: What a hidden secret is shown as.
MASK = "***"
#: How a JDBC URL begins (Spark's ``format("jdbc")`` and Java programs take these).
JDBC_PREFIX = "jdbc:"


def mask_password(url: str) -> str:
    """Hide the secrets of a database URL or libpq conninfo string, for logging.

    ``postgresql://u:secret@h/db`` becomes ``postgresql://u:***@h/db``; the
    ``password`` and ``sslpassword`` query parameters are masked too, and
    libpq ``key=value`` strings are handled as well.  Everything else is kept
    verbatim; strings without a secret are returned unchanged.

    Parameters:
      url(str): A URL such as ``postgresql+psycopg://user:pw@host:5432/db?sslmode=require``,
        or a conninfo string such as ``host=h password=pw``.

    Returns:
      str: The same string with each secret replaced by ``***``.
    """
    if "://" not in url:
        try:
            params = conninfo_to_dict(url)
        except psycopg.Error:
            return url
        if not any(params.get(key) is not None for key in SECRET_PARAMETERS):
            return url
        for key in SECRET_PARAMETERS & params.keys():
            params[key] = MASK
        return make_conninfo("", **params)

    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    userinfo, at, hostinfo = netloc.rpartition("@")
    if at and ":" in userinfo:
        username = userinfo.split(":", 1)[0]
        netloc = f"{username}:{MASK}@{hostinfo}"

    query = parts.query
    if query:
        pieces = []
        for piece in query.split("&"):
            key = urllib.parse.unquote_plus(piece.split("=", 1)[0])
            pieces.append(f"{key}={MASK}" if key in SECRET_PARAMETERS else piece)
        query = "&".join(pieces)

    if netloc == parts.netloc and query == parts.query:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def jdbc_url_error(url: str) -> str | None:
    """One line saying how to write a JDBC URL (``jdbc:postgresql://...``) for libpq, else None.

    ``jdbc:postgresql://h:5432/db`` is ``postgresql://h:5432/db`` without its ``jdbc:``
    (libpq reads the same ``user`` and ``password`` query parameters); the suggested URL
    has its secrets masked (:func:`mask_password`).

    Parameters:
      url(str): Any URL.

    Returns:
      str|None: The message for a JDBC URL, None for any other.
    """
    if not url[: len(JDBC_PREFIX)].lower() == JDBC_PREFIX:
        return None
    rest = url[len(JDBC_PREFIX) :]
    # mask_password of the whole URL would see "jdbc" as the scheme and miss a user-info password.
    shown = url[: len(JDBC_PREFIX)] + mask_password(rest)
    if rest.lower().startswith("postgresql://"):
        return f"{shown} is a JDBC URL; write it without 'jdbc:', as libpq takes it: {mask_password(rest)}"
    return f"{shown} is a JDBC URL; write it as libpq takes it: postgresql://USER:PASSWORD@HOST:PORT/DATABASE"


def safe_url(url: str | URL) -> str:
    """The URL as text with every secret masked (see :func:`mask_password`)."""
    text = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    return mask_password(text)


def normalize_sqlalchemy_url(url: str | URL) -> URL:
    """Return a SQLAlchemy URL that uses the psycopg 3 driver.

    ``postgresql://`` and ``postgres://`` URLs would otherwise select psycopg2.

    Raises:
      ValueError: If the URL is not a PostgreSQL URL.
    """
    from sqlalchemy.engine import make_url

    parsed = make_url(url) if isinstance(url, str) else url
    backend = parsed.get_backend_name()
    if backend not in ("postgresql", "postgres"):
        raise ValueError(f"Not a PostgreSQL URL: {safe_url(parsed)}")
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def libpq_url(url: str | URL) -> str:
    """Return a libpq connection URL (``postgresql://...``) for psycopg from any PostgreSQL URL.

    The user name, password, database name and query values are percent-encoded
    whole (:func:`percent_encode`), so that libpq reads back exactly the strings of
    the SQLAlchemy URL: SQLAlchemy's ``render_as_string`` leaves spaces in the user
    name, password and database name (libpq refuses them) and writes a space of a
    query value as ``+`` (libpq keeps a ``+``).  The host and port are kept as
    SQLAlchemy holds them (it never decodes a host, so a socket directory written
    ``%2Frun%2Fpostgresql`` stays encoded).

    Raises:
      ValueError: If the URL is not a PostgreSQL URL, or is a JDBC URL (the message says how
        to write it, see :func:`jdbc_url_error`; it masks the password).
    """
    from sqlalchemy.engine import make_url

    if isinstance(url, str) and (jdbc := jdbc_url_error(url)) is not None:
        raise ValueError(jdbc)
    parsed = make_url(url) if isinstance(url, str) else url
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise ValueError(f"Not a PostgreSQL URL: {safe_url(parsed)}")
    text = "postgresql://"
    if parsed.username is not None:
        text += percent_encode(parsed.username)
        if parsed.password is not None:
            text += ":" + percent_encode(str(parsed.password))
        text += "@"
    if parsed.host is not None:
        text += f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    if parsed.port is not None:
        text += f":{parsed.port}"
    if parsed.database is not None:
        text += "/" + percent_encode(parsed.database)
    if parsed.query:
        text += "?" + "&".join(
            f"{percent_encode(key)}={percent_encode(value)}"
            for key in sorted(parsed.query)
            for value in _values(parsed.query[key])
        )
    return text


def percent_encode(text: str) -> str:
    """``text`` for a libpq URL: each byte but letters, digits and ``-._~`` written ``%XX`` (UTF-8).

    libpq percent-decodes every part of a URL and nothing else (a ``+`` stays a ``+``).
    """
    return urllib.parse.quote(text, safe="")


def _values(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """A query parameter's values: SQLAlchemy holds a repeated parameter as a tuple."""
    return (value,) if isinstance(value, str) else value
