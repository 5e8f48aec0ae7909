"""Database URLs as they may be shown: in a repr, a log line or an error message.

Every place the package prints a URL or a libpq conninfo string goes through
:func:`mask_password` (or :func:`safe_url`), which hides the password in the
user-info part *and* in ``password``/``sslpassword`` query parameters
(SQLAlchemy's ``render_as_string(hide_password=True)`` hides only the former).
"""

from __future__ import annotations

import re
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


class URLError(ValueError):
    """A database URL this package reads but cannot use; the message says why and shows no password."""


#: What a hidden secret is shown as.
MASK = "***"
#: How a JDBC URL begins (Spark's ``format("jdbc")`` and Java programs take these).
JDBC_PREFIX = "jdbc:"
#: How a URL with several hosts is written, for error messages.
MULTI_HOST_SHAPE = "postgresql://USER@HOST1:PORT1,HOST2:PORT2/DATABASE?target_session_attrs=read-write"

#: A URL cut into scheme, network location, path and the rest (query, fragment).
_URL_PARTS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<netloc>[^/?#]*)(?P<rest>.*)", re.DOTALL)
#: One entry of libpq's host list: ``[v6 address]``, or a name, address or %-encoded socket
#: directory without ``:``; then an optional ``:port``.
_HOST_ENTRY = re.compile(r"(?:\[(?P<v6>[^\]]*)\]|(?P<name>[^:\[\]]*))(?::(?P<port>[^:]*))?")
#: SQLAlchemy's ``?host=name:port`` (psycopg dialect, ``_split_multihost_from_url``).
_QUERY_HOST_PORT = re.compile(r"(?P<name>[A-Za-z0-9.-]*):(?P<port>\d*)")
#: ``?host=[v6 address]:port``, which the JDBC mapping reads too.
_QUERY_V6_PORT = re.compile(r"\[(?P<name>[^\]]*)\](?::(?P<port>\d*))?")


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

    # Cut by hand, not with urllib.parse.urlsplit: that raises on some host lists ("Invalid
    # IPv6 URL"), and a URL that cannot be read must still be shown without its password.
    found = _URL_PARTS.fullmatch(url)
    if found is None:
        return url
    netloc = found["netloc"]
    userinfo, at, hostinfo = netloc.rpartition("@")
    if at and ":" in userinfo:
        username = userinfo.split(":", 1)[0]
        netloc = f"{username}:{MASK}@{hostinfo}"

    before, question, query_and_fragment = found["rest"].partition("?")
    query, hash_mark, fragment = query_and_fragment.partition("#")
    if query:
        pieces = []
        for piece in query.split("&"):
            key = urllib.parse.unquote_plus(piece.split("=", 1)[0])
            pieces.append(f"{key}={MASK}" if key in SECRET_PARAMETERS else piece)
        query = "&".join(pieces)

    return f"{found['scheme']}://{netloc}{before}{question}{query}{hash_mark}{fragment}"


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


def parse_url(url: str | URL) -> URL:
    """A database URL as a SQLAlchemy URL, libpq's list of hosts included.

    SQLAlchemy's ``make_url`` cannot read libpq's form of several hosts,
    ``postgresql://u@h1:5433,h2:5434/db`` (it raises ``ValueError``); this function
    writes the list as SQLAlchemy's ``postgresql://u@/db?host=h1,h2&port=5433,5434``
    first, which SQLAlchemy's psycopg dialect passes on to libpq as both hosts
    (libpq tries them in order; ``target_session_attrs=read-write`` makes it skip a
    server that does not accept writes).  An IPv6 address is written ``[::1]:5433``
    in the list; a %-encoded Unix-socket directory (``%2Frun%2Fpostgresql``) is
    allowed.  Every other URL is parsed by ``make_url`` as it is.

    Parameters:
      url(str|URL): A PostgreSQL URL; a SQLAlchemy ``URL`` is only checked.

    Returns:
      URL: The parsed URL.

    Raises:
      URLError: (a ``ValueError``) If the URL is a JDBC URL (see :func:`jdbc_url_error`),
        if an entry of its host list has no host or a port that is not a number, if it
        names its hosts both in the list and in ``?host=``/``?port=``, or gives repeated
        ``?host=HOST:PORT`` beside a ``?port=`` (which SQLAlchemy's psycopg dialect refuses
        too); the message shows the URL with its password masked.
      ValueError: ``make_url``'s errors for other malformed URLs.
    """
    from sqlalchemy.engine import make_url

    if isinstance(url, str):
        if (jdbc := jdbc_url_error(url)) is not None:
            raise URLError(jdbc)
        url = make_url(_host_list_in_query(url))
    _query_host_list({key: _values(value) for key, value in url.query.items()}, url)  # refuses a bad one
    return url


def _host_list_in_query(url: str) -> str:
    """``url`` with libpq's host list ``h1:p1,h2:p2`` moved to ``?host=h1,h2&port=p1,p2``.

    Raises:
      URLError: For an entry without a host or with a port that is not a number, or hosts
        given twice (in the list and in the query).
    """
    found = _URL_PARTS.fullmatch(url)
    if found is None:
        return url
    userinfo, at, hostinfo = found["netloc"].rpartition("@")
    if "," not in hostinfo:
        return url
    hosts: list[str] = []
    ports: list[str] = []
    for entry in hostinfo.split(","):
        parsed = _HOST_ENTRY.fullmatch(entry)
        host = None if parsed is None else parsed["v6"] if parsed["v6"] is not None else parsed["name"]
        if parsed is None or not host:
            raise URLError(_host_list_error(url, f"the entry {entry!r} of its host list has no host"))
        port = parsed["port"]
        if port is not None and not port.isdigit():
            raise URLError(_host_list_error(url, f"the port {port!r} of {entry!r} is not a number"))
        hosts.append(percent_encode(urllib.parse.unquote(host)))
        ports.append(port or "")
    path, _, query = found["rest"].partition("?")
    given = {urllib.parse.unquote_plus(piece.split("=", 1)[0]) for piece in query.split("&") if piece}
    if given & {"host", "hostaddr", "port"}:
        twice = ", ".join(f"?{key}=" for key in sorted(given & {"host", "hostaddr", "port"}))
        raise URLError(
            _host_list_error(url, f"it names its hosts twice, in its host list and in {twice}; keep one")
        )
    moved = f"host={','.join(hosts)}" + (f"&port={','.join(ports)}" if any(ports) else "")
    return f"{found['scheme']}://{userinfo}{at}{path}?{moved}{'&' if query else ''}{query}"


def _host_list_error(url: str, why: str) -> str:
    shown = mask_password(url)
    return f"cannot read the hosts of the database URL {shown}: {why}; expected {MULTI_HOST_SHAPE}"


def normalize_sqlalchemy_url(url: str | URL) -> URL:
    """Return a SQLAlchemy URL that uses the psycopg 3 driver.

    ``postgresql://`` and ``postgres://`` URLs would otherwise select psycopg2.  A URL
    with several hosts may be written in libpq's form (``postgresql://u@h1:5433,h2:5434/db``,
    see :func:`parse_url`): the URL returned holds them as SQLAlchemy's psycopg dialect
    takes them, so ``create_engine(normalize_sqlalchemy_url(url))`` connects to the first
    host that answers (and accepts writes, with ``?target_session_attrs=read-write``).

    Parameters:
      url(str|URL): A PostgreSQL URL.

    Returns:
      URL: The URL with the driver ``postgresql+psycopg``.

    Raises:
      ValueError: If the URL is not a PostgreSQL URL, or its host list is malformed
        (:func:`parse_url`).
    """
    parsed = parse_url(url)
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

    Several hosts, in any of the three forms (libpq's ``h1:5433,h2:5434`` before the
    database, SQLAlchemy's ``?host=h1:5433&host=h2:5434``, or the lists
    ``?host=h1,h2&port=5433,5434``), become libpq's lists ``?host=h1,h2&port=5433,5434``:
    libpq tries the hosts in order, and with ``?target_session_attrs=read-write`` skips
    one that does not accept writes (a standby, a server in read-only mode).

    Raises:
      ValueError: If the URL is not a PostgreSQL URL, or is a JDBC URL (the message says how
        to write it, see :func:`jdbc_url_error`; it masks the password); if its hosts are
        malformed (:func:`parse_url`), or given as repeated ``?host=HOST:PORT`` beside a
        ``?port=`` (which SQLAlchemy's psycopg dialect refuses too).
    """
    parsed = parse_url(url)
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
    query = {key: _values(value) for key, value in parsed.query.items()}
    listed = _query_host_list(query, parsed)
    if listed is not None:
        hosts, ports = listed
        query["host"] = (",".join(hosts),)
        if any(ports):
            query["port"] = (",".join(ports),)
    if query:
        text += "?" + "&".join(
            f"{percent_encode(key)}={_encode_value(key, value)}"
            for key in sorted(query)
            for value in query[key]
        )
    return text


def _query_host_list(query: dict[str, tuple[str, ...]], parsed: URL) -> tuple[list[str], list[str]] | None:
    """The hosts and ports of SQLAlchemy's ``?host=HOST:PORT`` (repeated or not), else None.

    As SQLAlchemy's psycopg dialect reads them: a single ``?host=name:port`` only without
    ``?port=``; an entry may also be ``[v6 address]:port``, or a host without a port.

    Raises:
      URLError: For repeated hosts beside ``?port=``, or a port that is not a number.
    """
    given = query.get("host", ())
    if len(given) == 1:
        single = _QUERY_HOST_PORT.fullmatch(given[0]) or _QUERY_V6_PORT.fullmatch(given[0])
        if single is None or "port" in query:
            return None
        return [single["name"]], [single["port"] or ""]
    if len(given) < 2:
        return None
    if "port" in query:
        raise URLError(
            f"the database URL {safe_url(parsed)} gives its hosts as repeated ?host=HOST:PORT and "
            "a ?port= too: write each port after its host (?host=h1:5433&host=h2:5434) or give two "
            "lists (?host=h1,h2&port=5433,5434)"
        )
    hosts: list[str] = []
    ports: list[str] = []
    for entry in given:
        v6 = _QUERY_V6_PORT.fullmatch(entry)
        if v6 is not None:
            host, port = v6["name"], v6["port"] or ""
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        else:  # a name, a bare IPv6 address or a socket directory
            host, port = entry, ""
        if (port and not port.isdigit()) or not host:
            raise URLError(
                f"the database URL {safe_url(parsed)} has ?host={entry}, which is not HOST or HOST:PORT "
                "(a port is a number)"
            )
        hosts.append(host)
        ports.append(port)
    return hosts, ports


def _encode_value(key: str, value: str) -> str:
    """A query value for libpq; the commas of a host or port list are kept readable."""
    if key in ("host", "hostaddr", "port"):
        return ",".join(percent_encode(piece) for piece in value.split(","))
    return percent_encode(value)


def percent_encode(text: str) -> str:
    """``text`` for a libpq URL: each byte but letters, digits and ``-._~`` written ``%XX`` (UTF-8).

    libpq percent-decodes every part of a URL and nothing else (a ``+`` stays a ``+``).
    """
    return urllib.parse.quote(text, safe="")


def _values(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """A query parameter's values: SQLAlchemy holds a repeated parameter as a tuple."""
    return (value,) if isinstance(value, str) else value
