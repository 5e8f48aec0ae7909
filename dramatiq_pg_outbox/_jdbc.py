"""A libpq URL as Spark JDBC options for the PostgreSQL JDBC driver (pgjdbc).

Public as :func:`dramatiq_pg_outbox.spark.jdbc_options`.  Every query
parameter of the URL is either carried (under pgjdbc's name for it, with its
value translated where the two spell it differently) or refused with a
``ValueError``: a connection that silently lost ``sslmode=verify-full`` would
still connect, without verifying the server.  Property names and values are
pgjdbc's (``org.postgresql.PGProperty``), checked against pgjdbc 42.7.13.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping

from .urls import parse_url, safe_url

#: The JDBC driver class.
JDBC_DRIVER = "org.postgresql.Driver"
#: Default PostgreSQL port.
DEFAULT_PORT = 5432


def _choice(parameter: str, mapping: Mapping[str, str], hint: str = "") -> Callable[[str], str]:
    """A translator that maps libpq values to pgjdbc values and refuses any other."""

    def translate(value: str) -> str:
        if value not in mapping:
            accepted = ", ".join(sorted(mapping))
            raise ValueError(
                f"{parameter}={value!r} cannot be passed to the PostgreSQL JDBC driver "
                f"(accepted: {accepted}){hint}"
            )
        return mapping[value]

    return translate


def _same(*values: str) -> dict[str, str]:
    return {v: v for v in values}


def _seconds(value: str) -> str:
    if not value.isdigit():
        raise ValueError(f"connect_timeout={value!r} must be a whole number of seconds")
    return value


def _root_cert(value: str) -> str:
    if value == "system":
        raise ValueError(
            "sslrootcert=system (libpq's system CA store) has no PostgreSQL JDBC driver equivalent "
            "here: pass the path of the CA certificate file"
        )
    return value


def _utf8(value: str) -> str:
    if value.replace("-", "").upper() not in ("UTF8", "UNICODE"):
        raise ValueError(f"client_encoding={value!r}: the PostgreSQL JDBC driver always uses UTF8")
    return ""


#: libpq URL parameter -> (pgjdbc property, value translator).  An empty
#: translated value means "nothing to pass" (pgjdbc already behaves so).
_PROPERTIES: dict[str, tuple[str, Callable[[str], str]]] = {
    "sslmode": (
        "sslmode",
        _choice("sslmode", _same("disable", "allow", "prefer", "require", "verify-ca", "verify-full")),
    ),
    "sslrootcert": ("sslrootcert", _root_cert),
    # pgjdbc reads the key as PKCS-8 (DER, or PEM in recent versions) or PKCS-12.
    "sslcert": ("sslcert", str),
    "sslkey": ("sslkey", str),
    "options": ("options", str),
    "connect_timeout": ("connectTimeout", _seconds),
    "application_name": ("ApplicationName", str),
    "fallback_application_name": ("ApplicationName", str),
    # pgjdbc decides "primary"/"secondary" by SHOW transaction_read_only, which
    # is what libpq's read-write/read-only do; libpq's primary/standby/
    # prefer-standby look at hot standby instead: not the same test.
    "target_session_attrs": (
        "targetServerType",
        _choice(
            "target_session_attrs",
            {"any": "any", "read-write": "primary", "read-only": "secondary"},
            " (pgjdbc tells servers apart by transaction_read_only only)",
        ),
    ),
    # channelBinding needs pgjdbc >= 42.7.4 (>= 42.7.12 to be safe from downgrades).
    "channel_binding": (
        "channelBinding",
        _choice("channel_binding", _same("disable", "prefer", "require")),
    ),
    "gssencmode": ("gssEncMode", _choice("gssencmode", _same("disable", "prefer", "require"))),
    "krbsrvname": ("kerberosServerName", str),
    "keepalives": ("tcpKeepAlive", _choice("keepalives", {"1": "true", "0": "false"})),
    "load_balance_hosts": (
        "loadBalanceHosts",
        _choice("load_balance_hosts", {"random": "true", "disable": "false"}),
    ),
    "client_encoding": ("", _utf8),
}
#: Secrets: passed as separate Spark options (driver properties), never in the URL.
_SECRETS = ("password", "sslpassword")
#: Where to connect; they shape the JDBC URL itself.
_LOCATION = ("host", "port", "dbname", "user")


def jdbc_options(url: str) -> dict[str, str]:
    """Spark JDBC reader/writer options for a PostgreSQL URL, with its connection parameters.

    Returns ``url`` (``jdbc:postgresql://host:port/db?...``), ``driver`` and,
    when given, ``user``, ``password`` and ``sslpassword``; Spark passes
    every option that is not one of its own to the driver as a connection
    property, so the secrets stay out of the URL string (which Spark may
    log).  libpq query parameters become pgjdbc properties in the URL:

    ===========================  ==========================================
    libpq                        pgjdbc
    ===========================  ==========================================
    sslmode                      sslmode (same six values)
    sslrootcert, sslcert,        sslrootcert, sslcert, sslkey (pgjdbc reads
    sslkey                       keys as PKCS-8 or PKCS-12)
    sslpassword                  sslpassword (option, not in the URL)
    options                      options
    connect_timeout (s)          connectTimeout (s)
    application_name,            ApplicationName
    fallback_application_name
    target_session_attrs         targetServerType: any -> any,
                                 read-write -> primary, read-only -> secondary
    channel_binding              channelBinding (pgjdbc >= 42.7.4)
    gssencmode                   gssEncMode
    krbsrvname                   kerberosServerName
    keepalives (1/0)             tcpKeepAlive (true/false)
    load_balance_hosts           loadBalanceHosts (random -> true)
    client_encoding (UTF8 only)  (pgjdbc always uses UTF8)
    host, port, dbname, user     the URL's hosts, ports, database; user
    ===========================  ==========================================

    Several hosts (``?host=a:5432&host=b:5433``, SQLAlchemy's form, or
    ``?host=a,b&port=5432,5433``, libpq's) become ``jdbc:postgresql://a:5432,b:5433/db``.
    Without a host, pgjdbc connects to ``localhost`` over TCP.

    Parameters:
      url(str): A PostgreSQL URL (``postgresql://``, ``postgresql+psycopg://``...).

    Raises:
      ValueError: For a URL that is not PostgreSQL, a Unix-socket host, a
        repeated parameter, and any parameter or value pgjdbc cannot be given
        (``sslrootcert=system``, ``target_session_attrs=standby``, ``passfile``,
        ``service``, ``hostaddr``, ``sslcrl``...): the message names it.

    Returns:
      dict[str, str]: Options for ``spark.read.format("jdbc").options(**...)``.
    """
    parsed = parse_url(url)
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise ValueError(f"Not a PostgreSQL URL: {safe_url(parsed)}")
    query: dict[str, tuple[str, ...]] = {
        key: (value,) if isinstance(value, str) else tuple(value) for key, value in parsed.query.items()
    }
    for key, values in query.items():
        if key != "host" and len(values) > 1:
            raise ValueError(f"URL parameter {key!r} is given {len(values)} times; give it once")
    params = {key: values[0] for key, values in query.items() if key != "host"}

    unknown = sorted(set(params) - set(_PROPERTIES) - set(_SECRETS) - set(_LOCATION))
    if unknown:
        raise ValueError(
            f"URL parameter(s) {', '.join(unknown)} cannot be passed to the PostgreSQL JDBC driver "
            f"by jdbc_options; supported: {', '.join(sorted([*_PROPERTIES, *_SECRETS, *_LOCATION]))}"
        )

    properties: dict[str, str] = {"stringtype": "unspecified"}
    for key, value in params.items():
        if key in _PROPERTIES:
            name, translate = _PROPERTIES[key]
            translated = translate(value)
            if name and translated and not (key == "fallback_application_name" and name in properties):
                properties[name] = translated

    servers = _servers(query.get("host", ()), params.get("port"), parsed.host, parsed.port)
    database = params.get("dbname", parsed.database or "")
    jdbc_url = f"jdbc:postgresql://{','.join(servers)}/{urllib.parse.quote(database, safe='')}?" + "&".join(
        f"{name}={urllib.parse.quote(value, safe='')}" for name, value in properties.items()
    )
    options = {"url": jdbc_url, "driver": JDBC_DRIVER}
    user = params.get("user", parsed.username)
    if user:
        options["user"] = user
    password = params.get("password", parsed.password)
    if password:
        options["password"] = str(password)
    if params.get("sslpassword"):
        options["sslpassword"] = params["sslpassword"]
    return options


def _servers(
    host_params: tuple[str, ...], port_param: str | None, url_host: str | None, url_port: int | None
) -> list[str]:
    """``host:port`` entries of the JDBC URL (IPv6 addresses in brackets).

    Raises:
      ValueError: For a Unix-socket directory, or port and host lists of different lengths.
    """
    hosts = [h for entry in host_params for h in entry.split(",")] or [url_host or "localhost"]
    ports = port_param.split(",") if port_param else [str(url_port or DEFAULT_PORT)]
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts):
        raise ValueError(f"{len(hosts)} hosts but {len(ports)} ports in the URL")
    servers = []
    for host, port in zip(hosts, ports, strict=True):
        if host.startswith("/") or host.startswith("@"):
            raise ValueError(
                f"host={host!r} is a Unix-domain socket; the PostgreSQL JDBC driver connects over TCP: "
                "give a host name or address"
            )
        if host.startswith("["):  # [v6]:port or [v6]
            address, _, rest = host[1:].partition("]")
            host, port = address, rest[1:] if rest.startswith(":") else port
        elif host.count(":") == 1:  # SQLAlchemy's host=name:port
            host, port = host.split(":")
        if not port.isdigit():
            raise ValueError(f"port {port!r} in the URL is not a number")
        servers.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return servers
