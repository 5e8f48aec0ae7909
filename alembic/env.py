"""Alembic environment of dramatiq-pg-outbox.

Runs the package's own revisions with their own version table
(``<schema>.dramatiq_pg_outbox_version``) so that they never collide with
an application's ``alembic_version``.  Used by ``dramatiq-pg-outbox migrate``
and :func:`dramatiq_pg_outbox.upgrade`; applications that prefer to keep our
revisions in their own history point ``version_locations`` at
:func:`dramatiq_pg_outbox.migrations.versions_path` instead (see the README).

The target schema comes from, in order: ``config.attributes["dramatiq_pg_outbox_schema"]``,
``-x dramatiq_pg_outbox_schema=NAME``, ``$DRAMATIQ_PG_OUTBOX_SCHEMA``, then ``dramatiq``.
"""

from __future__ import annotations

from sqlalchemy import create_engine, pool, text
from sqlalchemy.engine import Connection

from alembic import context
from dramatiq_pg_outbox.migrations import (
    ISOLATION_LEVEL,
    MIGRATION_LOCK_KEY,
    VERSION_TABLE,
    create_schema_sql,
    normalize_sqlalchemy_url,
    schema_for_migration,
)

config = context.config
schema = schema_for_migration()


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url") or "postgresql://",
        literal_binds=True,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.execute(create_schema_sql(schema))
        context.run_migrations()


def _run(connection: Connection) -> None:
    # Serialise concurrent upgrades (several processes migrating at start).
    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
    connection.execute(text(create_schema_sql(schema)))
    context.configure(
        connection=connection,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = normalize_sqlalchemy_url(config.get_main_option("sqlalchemy.url") or "")
    engine = create_engine(url, poolclass=pool.NullPool, isolation_level=ISOLATION_LEVEL)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
