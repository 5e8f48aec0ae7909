"""Schema migrations: alembic revisions shipped inside the package.

Two ways to run them (both documented in docs/guides/migrations.md):

1. Our own migration environment and version table
   (``<schema>.dramatiq_pg_outbox_version``): ``dramatiq-pg-outbox migrate`` or
   :func:`upgrade` from Python, on a URL, an ``Engine`` or a ``Connection``.
2. Inside an application's own alembic history: add :func:`versions_path` to
   ``version_locations`` and ``alembic upgrade heads``; our revisions carry the
   branch label ``dramatiq_pg_outbox``.

Each revision also records its number in the comment of the ``messages``
table, so the broker can check the schema whichever route created it
(:func:`check_schema`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sqlalchemy import create_engine, pool
from sqlalchemy.engine import URL, Connection, Engine

from .errors import SchemaNotReady
from .names import DEFAULT_SCHEMA as DEFAULT_SCHEMA
from .names import quote_ident as quote_ident
from .names import validate_schema_name as validate_schema_name
from .store.admin import AdminStore
from .store.messages import SchemaRevision, message_store
from .urls import libpq_url as libpq_url
from .urls import normalize_sqlalchemy_url as normalize_sqlalchemy_url

if TYPE_CHECKING:
    import psycopg

#: Name of the alembic version table of our own environment.
VERSION_TABLE = "dramatiq_pg_outbox_version"
#: Revision number of the newest migration; the broker requires it.
SCHEMA_REVISION = 24
#: Isolation level of the migrations' own connections (``upgrade(url)``, ``migrate``): the revisions'
#: statements were written for it, whatever the database's default (docs/guarantees.md, "Isolation
#: levels").  psycopg begins each transaction with it, which holds behind PgBouncer too.
ISOLATION_LEVEL = "READ COMMITTED"
#: Key of the advisory lock that serialises concurrent upgrades.
MIGRATION_LOCK_KEY = 7_261_533_180_214_001
#: Environment variable naming the schema for alembic runs.
SCHEMA_ENV_VAR = "DRAMATIQ_PG_OUTBOX_SCHEMA"

_COMMENT = re.compile(r"dramatiq-pg-outbox schema revision (\d+)")


def create_schema_sql(schema: str) -> str:
    """SQL that creates ``schema`` only if it does not exist yet.

    ``CREATE SCHEMA IF NOT EXISTS`` checks the CREATE privilege on the
    database even when the schema exists; this statement does not, so a
    migration role may run in a schema that a DBA created for it
    (``CREATE SCHEMA dramatiq AUTHORIZATION ...``, see docs/security.md)
    without any privilege on the database.
    """
    return AdminStore(schema).create_schema_sql()


def script_location() -> str:
    """Path of the alembic environment: inside the installed wheel, else the source tree's ``alembic/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_alembic", here.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return str(candidate)
    raise RuntimeError("dramatiq-pg-outbox is installed without its migrations; reinstall the package.")


def versions_path() -> str:
    """Path of the folder holding our revisions, for an application's ``version_locations``."""
    return str(Path(script_location()) / "versions")


def revision_module(filename: str) -> ModuleType:
    """A private copy of one of our revisions' modules, by file name (``"0013_message_ring.py"``).

    A revision that re-creates an earlier one's function reads the earlier code this way;
    alembic's own copy of the module is left alone.

    Raises:
      FileNotFoundError: If ``alembic/versions`` has no such file.
    """
    path = Path(versions_path()) / filename
    spec = importlib.util.spec_from_file_location(f"_dramatiq_pg_outbox_{path.stem}", path)
    if spec is None or spec.loader is None or not path.exists():
        raise FileNotFoundError(path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schema_for_migration() -> str:
    """The schema an alembic run targets (see ``alembic/env.py``). Only valid inside a run."""
    from alembic import context

    schema = context.config.attributes.get("dramatiq_pg_outbox_schema")
    if not schema:
        schema = context.get_x_argument(as_dictionary=True).get("dramatiq_pg_outbox_schema")
    if not schema:
        schema = os.environ.get(SCHEMA_ENV_VAR, DEFAULT_SCHEMA)
    return validate_schema_name(str(schema))


def set_schema_revision(execute: Callable[[str], Any], schema: str, number: int) -> None:
    """Record revision ``number`` in the comment of ``<schema>.messages`` (used by revisions)."""
    AdminStore(schema).set_schema_revision(execute, revision=number)


def parse_schema_revision(comment: str | None) -> int | None:
    """Revision number from the ``messages`` table comment, or ``None``."""
    if not comment:
        return None
    found = _COMMENT.search(comment)
    return int(found.group(1)) if found else None


#: The environment variable that the CLI reads a URL from, and the suggested commands name.
URL_VARIABLE = "DATABASE_URL"
#: ``--url`` of a suggested command when the URL has a password: the variable, quoted for a shell.
FIX_URL = f'"${URL_VARIABLE}"'


def schema_not_ready(
    schema: str,
    row: SchemaRevision | Sequence[Any] | None,
    *,
    url: str,
    fix_url: str | None = None,
    minimum: int = SCHEMA_REVISION,
    reader: str = "this version",
) -> SchemaNotReady | None:
    """The error to raise for a schema, from the row of the ``schema_revision`` query.

    The one schema check: one rule and one wording for every caller (the broker,
    ``outbox()``, the CLI, the dashboard): what is wrong and the
    ``dramatiq-pg-outbox migrate`` command that fixes it.

    Parameters:
      schema(str): The schema holding the tables.
      row(SchemaRevision|Sequence|None): The ``schema_revision`` statement's answer
        (:meth:`~.store.messages.MessageStore.schema_revision`), or its row as another driver
        returns it: ``(messages table exists, its comment)``; ``None`` counts as missing.
      url(str): The database, as it may be shown (password masked).
      fix_url(str|None): What to pass to ``--url`` in the command, quoted for a shell: a URL
        without a password, or ``"$DATABASE_URL"`` when that variable holds it.  Default None
        (the URL has a password, which is never shown): ``"$DATABASE_URL"``, and the message
        says to set that variable first, so that the command can be pasted as it is.
      minimum(int): The oldest revision the reader works with.  Default :data:`SCHEMA_REVISION`.
      reader(str): Who needs it, in the message.  Default ``"this version"``.

    Returns:
      SchemaNotReady|None: The error when the tables are missing or older than
      ``minimum``, else ``None``.
    """
    found = SchemaRevision(False, None) if row is None else SchemaRevision(*row)
    exists, comment = found.exists, found.comment
    fix = f"dramatiq-pg-outbox migrate --url {fix_url or FIX_URL} --schema {schema}"
    if fix_url is None:
        fix += f" (after setting {URL_VARIABLE} to the URL of that database, its password included)"
    if not exists:
        return SchemaNotReady(
            f"The dramatiq-pg-outbox tables do not exist in schema {schema!r} of {url}. Run: {fix}"
        )
    revision = parse_schema_revision(comment)
    if revision is None or revision < minimum:
        at = "an unknown revision" if revision is None else f"revision {revision}"
        needs = f"{reader} needs {minimum}"
        if minimum != SCHEMA_REVISION:
            needs += f" or later (and this version's workers {SCHEMA_REVISION})"
        return SchemaNotReady(
            f"The dramatiq-pg-outbox schema {schema!r} of {url} is at {at}, {needs}. Run: {fix}"
        )
    return None


def check_schema(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    url: str,
    fix_url: str | None = None,
    minimum: int = SCHEMA_REVISION,
    reader: str = "this version",
) -> int:
    """Check that ``schema`` holds the tables at the revision its reader needs.

    Parameters:
      conn(psycopg.Connection): A connection to the database to check.
      schema(str): The schema holding the tables.
      url(str): The database, as it may be shown in the error (password masked).
      fix_url(str|None): What the error's ``migrate`` command passes to ``--url`` (see
        :func:`schema_not_ready`).
      minimum(int), reader(str): As for :func:`schema_not_ready`.

    Raises:
      SchemaNotReady: If the tables are missing or old; the message names the
        command that fixes it (see :func:`schema_not_ready`).

    Returns:
      int: The schema's revision number.
    """
    with conn.cursor() as cur:
        found = message_store(schema).schema_revision(cur)
    error = schema_not_ready(schema, found, url=url, fix_url=fix_url, minimum=minimum, reader=reader)
    if error is not None:
        raise error
    return parse_schema_revision(found.comment) or 0


def alembic_config(schema: str, url: str | None = None) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["dramatiq_pg_outbox_schema"] = schema
    return cfg


def upgrade(
    connection_or_url: str | URL | Engine | Connection,
    *,
    schema: str = DEFAULT_SCHEMA,
    revision: str = "head",
) -> None:
    """Create or upgrade the broker's tables.

    Idempotent and safe to call from several processes at once (an advisory
    lock serialises them).

    Parameters:
      connection_or_url(str|URL|Engine|Connection): Where to migrate.  With a
        ``Connection`` the migration runs in that connection's transaction, at its
        isolation level (give it READ COMMITTED: revisions that copy a table miss
        rows committed after a REPEATABLE READ snapshot), and the caller commits;
        a URL or an ``Engine`` runs at READ COMMITTED.
      schema(str): The schema holding the tables; created if missing.  Default ``dramatiq``.
      revision(str): Target alembic revision.  Default ``head``.

    Raises:
      ValueError: If ``schema`` is not a valid name or the URL is not PostgreSQL.
    """
    from alembic import command

    _run_alembic(command.upgrade, connection_or_url, schema, revision)


def downgrade(
    connection_or_url: str | URL | Engine | Connection, *, schema: str = DEFAULT_SCHEMA, revision: str
) -> None:
    """Downgrade to ``revision`` (``base`` drops the tables).  Arguments as for :func:`upgrade`."""
    from alembic import command

    _run_alembic(command.downgrade, connection_or_url, schema, revision)


def _run_alembic(
    run: Callable[[Any, str], None],
    connection_or_url: str | URL | Engine | Connection,
    schema: str,
    revision: str,
) -> None:
    """Run an alembic command on a Connection (caller commits), an Engine or a URL (committed here)."""
    validate_schema_name(schema)
    if isinstance(connection_or_url, Connection):
        cfg = alembic_config(schema)
        cfg.attributes["connection"] = connection_or_url
        run(cfg, revision)
        return
    if isinstance(connection_or_url, Engine):
        # READ COMMITTED whatever the engine's level: each revision's statements were written for it.
        with connection_or_url.execution_options(isolation_level=ISOLATION_LEVEL).begin() as conn:
            _run_alembic(run, conn, schema, revision)
        return
    engine = create_engine(
        normalize_sqlalchemy_url(connection_or_url), poolclass=pool.NullPool, isolation_level=ISOLATION_LEVEL
    )
    try:
        with engine.begin() as conn:
            _run_alembic(run, conn, schema, revision)
    finally:
        engine.dispose()


def upgrade_sql(schema: str = DEFAULT_SCHEMA, revision: str = "head", start: str | None = None) -> None:
    """Print the SQL of an upgrade to standard output without connecting (alembic offline mode).

    Parameters:
      schema(str): The schema of the tables.
      revision(str): The revision to reach.  Default ``"head"``.
      start(str|None): The revision the database is at (``"0012"``): the SQL upgrades from
        there.  Default None: from an empty schema.
    """
    from alembic import command

    target = revision if start is None else f"{start}:{revision}"
    command.upgrade(alembic_config(validate_schema_name(schema), "postgresql+psycopg://"), target, sql=True)
