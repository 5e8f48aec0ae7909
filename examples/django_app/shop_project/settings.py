"""Settings of the example shop: two PostgreSQL databases and django_dramatiq on PostgresBroker.

The databases come from the environment (``SHOP_DB_HOST``, ``SHOP_DB_PORT``, ``SHOP_DB_USER``,
``SHOP_DB_PASSWORD``, ``SHOP_DB_NAME`` for the orders, ``SHOP_LEDGER_DB_NAME`` for the ledger, on
the same server); by default the local server's ``shop`` and ``shop_ledger`` databases.  The tests
create databases of their own (see ``conftest.py``).
"""

from __future__ import annotations

import os

from dramatiq_pg_outbox.django import database_url


def _database(name: str) -> dict[str, str]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "HOST": os.environ.get("SHOP_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("SHOP_DB_PORT", "5432"),
        "USER": os.environ.get("SHOP_DB_USER", "postgres"),
        "PASSWORD": os.environ.get("SHOP_DB_PASSWORD", ""),
    }


SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "only-for-the-example")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
ROOT_URLCONF = "shop_project.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    # First: its AppConfig builds the broker from DRAMATIQ_BROKER and sets it as Dramatiq's global broker.
    "django_dramatiq",
    "shop",
]

DATABASES = {
    # Orders, and the queues of the broker below (run `dramatiq-pg-outbox migrate` on it).
    "default": _database(os.environ.get("SHOP_DB_NAME", "shop")),
    # A second database: the ledger, with queues of its own (tests: outbox(using="ledger", ...)).
    "ledger": _database(os.environ.get("SHOP_LEDGER_DB_NAME", "shop_ledger")),
}

# django_dramatiq builds PostgresBroker(middleware=[...], **OPTIONS); `manage.py rundramatiq` runs
# the workers.  The broker's queues live in the "default" database, so that
# `with transaction.atomic(), outbox():` stores the messages with the orders.
DRAMATIQ_BROKER = {
    "BROKER": "dramatiq_pg_outbox.PostgresBroker",
    "OPTIONS": {"url": database_url(DATABASES["default"])},
    "MIDDLEWARE": [
        "dramatiq.middleware.AgeLimit",
        "dramatiq.middleware.TimeLimit",
        "dramatiq.middleware.Callbacks",
        "dramatiq.middleware.Retries",
        # Records every message in django_dramatiq's Task table (its after_enqueue hook runs
        # only for messages that committed: see dramatiq_pg_outbox.django).
        "django_dramatiq.middleware.AdminMiddleware",
        "django_dramatiq.middleware.DbConnectionsMiddleware",
    ],
}
