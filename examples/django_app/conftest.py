"""The example's test setup: two fresh databases, migrated, then Django on them.

Like the main suite, the tests never touch an existing database: the server comes from
``$DRAMATIQ_PG_OUTBOX_TEST_URL`` (an admin URL), else Docker, the local server or a throwaway
one (:func:`dramatiq_pg_outbox.testing.postgres_server`), and two databases ``dpo_shop_<random>``
and ``dpo_ledger_<random>`` are created, given the broker's tables (``upgrade``) and Django's
(``migrate``), and dropped at the end.  This runs when pytest loads this file, before
pytest-django sets Django up: the settings read the databases from ``SHOP_DB_*`` variables,
which worker processes started by the tests inherit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import django
import pytest
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox import upgrade
from dramatiq_pg_outbox.testing import postgres_server, scratch_database

_databases = contextlib.ExitStack()


def _create_databases() -> None:
    admin_url = _databases.enter_context(postgres_server("DRAMATIQ_PG_OUTBOX_TEST_URL"))
    shop_url = _databases.enter_context(scratch_database(admin_url, "dpo_shop"))
    ledger_url = _databases.enter_context(scratch_database(admin_url, "dpo_ledger"))
    for url in (shop_url, ledger_url):
        upgrade(url)
    shop, ledger = make_url(shop_url), make_url(ledger_url)
    os.environ.update(
        SHOP_DB_HOST=shop.host or "",
        SHOP_DB_PORT=str(shop.port or ""),
        SHOP_DB_USER=shop.username or "",
        SHOP_DB_PASSWORD=shop.password or "",
        SHOP_DB_NAME=shop.database or "",
        SHOP_LEDGER_DB_NAME=ledger.database or "",
        DJANGO_SETTINGS_MODULE="shop_project.settings",
    )


try:
    _create_databases()
except BaseException:
    _databases.close()
    raise
django.setup()


def pytest_unconfigure(config: pytest.Config) -> None:
    from django.db import connections

    connections.close_all()
    _databases.close()


@pytest.fixture(scope="session")
def django_db_setup(django_db_blocker: Any) -> Iterator[None]:
    """Use the databases created above (instead of pytest-django's ``test_`` copies), with Django's tables."""
    from django.core.management import call_command

    with django_db_blocker.unblock():
        for alias in ("default", "ledger"):
            call_command("migrate", database=alias, verbosity=0)
    yield
