"""dramatiq_pg_outbox.django.database_url(): the broker's URL from a Django database's settings."""

from __future__ import annotations

import psycopg
import pytest

from dramatiq_pg_outbox.django import database_url


def test_database_url_carries_every_connection_setting_and_libpq_option() -> None:
    # Given a Django database with a password to quote, a port and options for libpq and for Django
    settings = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "shop",
        "USER": "app",
        "PASSWORD": "p@ss:/w rd",
        "HOST": "db.internal",
        "PORT": "6432",
        "OPTIONS": {
            "sslmode": "require",
            "application_name": "shop web",
            "server_side_binding": True,
            "isolation_level": 2,
            "prepare_threshold": 5,
        },
    }
    # Then the URL gives libpq the same connection, and Django's own options are left out
    assert psycopg.conninfo.conninfo_to_dict(database_url(settings)) == {
        "dbname": "shop",
        "user": "app",
        "password": "p@ss:/w rd",
        "host": "db.internal",
        "port": "6432",
        "sslmode": "require",
        "application_name": "shop web",
    }


def test_database_url_takes_a_socket_directory_as_host() -> None:
    url = database_url({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "HOST": "/run/postgresql"})
    assert psycopg.conninfo.conninfo_to_dict(url) == {"dbname": "shop", "host": "/run/postgresql"}


def test_database_url_refuses_another_database_engine() -> None:
    with pytest.raises(ValueError, match=r"needs a PostgreSQL .*not 'django\.db\.backends\.sqlite3'"):
        database_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"})
