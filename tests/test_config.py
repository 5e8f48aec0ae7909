"""Broker options: validated in one place, the NOTIFY channel of any schema, masked passwords."""

from __future__ import annotations

import logging
import math
import queue
from typing import Any
from urllib.parse import quote

import dramatiq
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import create_engine
from sqlalchemy.engine import URL, make_url

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.errors import SchemaNotReady
from dramatiq_pg_outbox.migrations import libpq_url
from dramatiq_pg_outbox.names import MAX_CHANNEL_BYTES, channel_for
from dramatiq_pg_outbox.options import BrokerOptions
from dramatiq_pg_outbox.urls import mask_password
from tests.helpers import wait_for

#: Nothing listens there: constructing a broker must not connect.
NOWHERE = "postgresql://nobody@127.0.0.1:1/none"

# -- every option is validated, with the option, the value and the rule in the message --

INTEGER = "must be an integer"
MILLISECONDS = "must be an integer number of milliseconds"

BAD_OPTIONS: list[tuple[dict[str, Any], str, str]] = [
    # (options, the option named in the error, a piece of the rule)
    ({"pool_size": 0}, "pool_size", f"{INTEGER} >= 1"),
    ({"pool_size": -1}, "pool_size", f"{INTEGER} >= 1"),
    ({"pool_size": 4.0}, "pool_size", INTEGER),
    ({"pool_size": True}, "pool_size", INTEGER),
    ({"pool_size": "4"}, "pool_size", INTEGER),
    ({"pool_size": None}, "pool_size", INTEGER),
    ({"pool_timeout": 0}, "pool_timeout", f"{MILLISECONDS} >= 1"),
    ({"pool_timeout": 10.0}, "pool_timeout", MILLISECONDS),
    ({"pool_timeout": True}, "pool_timeout", MILLISECONDS),
    ({"max_deliveries": 0}, "max_deliveries", f"{INTEGER} >= 1"),
    ({"max_deliveries": 2.0}, "max_deliveries", INTEGER),
    ({"max_deliveries": False}, "max_deliveries", INTEGER),
    ({"overfetch_factor": 0}, "overfetch_factor", "a finite number > 0"),
    ({"overfetch_factor": -1.0}, "overfetch_factor", "a finite number > 0"),
    ({"overfetch_factor": math.nan}, "overfetch_factor", "a finite number > 0"),
    ({"overfetch_factor": math.inf}, "overfetch_factor", "a finite number > 0"),
    ({"overfetch_factor": True}, "overfetch_factor", "a finite number > 0"),
    ({"overfetch_factor": "4"}, "overfetch_factor", "a finite number > 0"),
    ({"min_fetch_interval": -1}, "min_fetch_interval", f"{MILLISECONDS} >= 0"),
    ({"min_fetch_interval": 0.5}, "min_fetch_interval", MILLISECONDS),
    ({"max_fetch_interval": 0}, "max_fetch_interval", f"{MILLISECONDS} >= 1"),
    ({"max_fetch_interval": 1000.0}, "max_fetch_interval", MILLISECONDS),
    ({"flush_interval": -1}, "flush_interval", f"{MILLISECONDS} >= 0"),
    ({"flush_interval": 5.0}, "flush_interval", MILLISECONDS),
    ({"max_flush_delay": -1}, "max_flush_delay", f"{MILLISECONDS} >= 0"),
    ({"max_flush_delay": 20.0}, "max_flush_delay", MILLISECONDS),
    ({"max_flush_delay": True}, "max_flush_delay", MILLISECONDS),
    ({"max_flush_delay": "20"}, "max_flush_delay", MILLISECONDS),
    ({"max_flush_delay": 4}, "max_flush_delay", "at least flush_interval (5 ms)"),
    (
        {"flush_interval": 50, "max_flush_delay": 20},
        "max_flush_delay",
        "at least flush_interval (50 ms), the shortest window; pass max_flush_delay=flush_interval",
    ),
    ({"flush_batch_size": 0}, "flush_batch_size", f"{INTEGER} >= 1"),
    ({"flush_batch_size": -5}, "flush_batch_size", f"{INTEGER} >= 1"),
    ({"flush_batch_size": 10.0}, "flush_batch_size", INTEGER),
    ({"flush_batch_size": True}, "flush_batch_size", INTEGER),
    ({"heartbeat_interval": 0}, "heartbeat_interval", f"{MILLISECONDS} >= 1"),
    ({"heartbeat_interval": 5000.0}, "heartbeat_interval", MILLISECONDS),
    ({"heartbeat_timeout": 0}, "heartbeat_timeout", f"{MILLISECONDS} >= 1"),
    ({"heartbeat_timeout": 20000.0}, "heartbeat_timeout", MILLISECONDS),
    (
        {"heartbeat_interval": 5_000, "heartbeat_timeout": 5_000},
        "heartbeat_timeout",
        "at least 2 x heartbeat_interval (2 x 5000 = 10000 ms)",
    ),
    (
        {"heartbeat_interval": 5_000, "heartbeat_timeout": 1_000},
        "heartbeat_timeout",
        "at least 2 x heartbeat_interval (2 x 5000 = 10000 ms)",
    ),
    (
        {"heartbeat_interval": 5_000, "heartbeat_timeout": 9_999},
        "heartbeat_timeout",
        "at least 2 x heartbeat_interval",
    ),
    ({"rescue_interval": -1}, "rescue_interval", f"{MILLISECONDS} >= 0"),
    ({"rescue_interval": 5000.5}, "rescue_interval", MILLISECONDS),
    ({"max_lease": 0}, "max_lease", f"{MILLISECONDS} >= 1"),
    ({"max_lease": -1}, "max_lease", f"{MILLISECONDS} >= 1"),
    ({"max_lease": 60.5}, "max_lease", MILLISECONDS),
    ({"max_lease": True}, "max_lease", MILLISECONDS),
    ({"notify": "sometimes"}, "notify", "'transaction', 'after_commit' or 'off'"),
    ({"notify": None}, "notify", "'transaction', 'after_commit' or 'off'"),
    ({"notify": True}, "notify", "'transaction', 'after_commit' or 'off'"),
    ({"listen": 1}, "listen", "True or False"),
    ({"listen": "yes"}, "listen", "True or False"),
    ({"listen": None}, "listen", "True or False"),
    ({"check_schema": 0}, "check_schema", "True or False"),
    ({"check_schema": "no"}, "check_schema", "True or False"),
    ({"prepare_threshold": -1}, "prepare_threshold", "None (never prepare a statement"),
    ({"prepare_threshold": 5.0}, "prepare_threshold", "or an integer >= 0"),
    ({"prepare_threshold": False}, "prepare_threshold", "or an integer >= 0"),
    ({"prepare_threshold": "None"}, "prepare_threshold", "or an integer >= 0"),
]


@pytest.mark.parametrize(
    ("options", "name", "rule"), BAD_OPTIONS, ids=[f"{n}={o[n]!r}" for o, n, _ in BAD_OPTIONS]
)
def test_an_invalid_option_is_refused_naming_the_option_the_value_and_the_rule(
    options: dict[str, Any], name: str, rule: str
) -> None:
    # When a broker is built with one bad option (on an unreachable URL: no connection is tried)
    with pytest.raises(ValueError) as excinfo:
        PostgresBroker(url=NOWHERE, **options)
    # Then the error says which option, which value and which rule
    message = str(excinfo.value)
    assert message.startswith(f"{name}={options[name]!r} is invalid: "), message
    assert rule in message


GOOD_OPTIONS: list[dict[str, Any]] = [
    {"pool_size": 1},
    {"pool_timeout": 1},
    {"max_deliveries": 1},
    {"overfetch_factor": 0.5},
    {"overfetch_factor": 2},
    {"min_fetch_interval": 0},
    {"max_fetch_interval": 1},
    {"flush_interval": 0},
    {"flush_batch_size": 1},
    {"max_flush_delay": 5},
    {"flush_interval": 0, "max_flush_delay": 0},
    {"flush_interval": 50, "max_flush_delay": 50},
    {"heartbeat_interval": 1, "heartbeat_timeout": 2},
    {"heartbeat_interval": 5_000, "heartbeat_timeout": 10_000},
    {"heartbeat_interval": 600_000, "heartbeat_timeout": 1_200_000, "rescue_interval": 600_000},
    {"rescue_interval": 0},
    {"max_lease": None},
    {"max_lease": 1},
    {"notify": "transaction"},
    {"notify": "after_commit"},
    {"notify": "off"},
    {"listen": False},
    {"check_schema": False},
    {"prepare_threshold": None},
    {"prepare_threshold": 0},
]


@pytest.mark.parametrize("options", GOOD_OPTIONS, ids=[repr(o) for o in GOOD_OPTIONS])
def test_options_at_the_edge_of_their_range_are_accepted_and_kept_as_attributes(
    options: dict[str, Any],
) -> None:
    broker = PostgresBroker(url=NOWHERE, **options)
    for name, value in options.items():
        assert getattr(broker, name) == value


def test_the_defaults_pass_their_own_rules() -> None:
    broker = PostgresBroker(url=NOWHERE)
    defaults = BrokerOptions()
    assert (broker.flush_batch_size, broker.heartbeat_timeout) == (1_000, 20_000)
    assert broker.heartbeat_timeout >= 2 * broker.heartbeat_interval
    assert defaults.overfetch_factor == broker.overfetch_factor == 16.0


def test_max_flush_delay_by_default_is_20_ms_or_flush_interval_if_longer() -> None:
    assert PostgresBroker(url=NOWHERE).max_flush_delay == 20
    assert PostgresBroker(url=NOWHERE, flush_interval=3).max_flush_delay == 20
    assert PostgresBroker(url=NOWHERE, flush_interval=500).max_flush_delay == 500


def test_an_integer_overfetch_factor_is_stored_as_a_float() -> None:
    assert isinstance(PostgresBroker(url=NOWHERE, overfetch_factor=2).overfetch_factor, float)


# -- the NOTIFY channel fits PostgreSQL's 63-byte limit for every valid schema name --


@pytest.mark.parametrize("schema", ["dramatiq", "a", "x" * 44])
def test_the_channel_of_a_short_schema_is_unchanged(schema: str) -> None:
    assert channel_for(schema) == f"dramatiq_pg_outbox.{schema}"
    assert PostgresBroker(url=NOWHERE, schema=schema).channel == f"dramatiq_pg_outbox.{schema}"


@pytest.mark.parametrize("schema", ["x" * 45, "y" * 63, "Long_Schema_Name_" + "9" * 46])
def test_the_channel_of_a_long_schema_is_shortened_with_a_hash_to_63_bytes(schema: str) -> None:
    channel = channel_for(schema)
    assert len(channel.encode()) == MAX_CHANNEL_BYTES
    # Readable start, then a "." that no schema name contains, then the hash.
    prefix, _, digest = channel.rpartition(".")
    assert prefix == f"dramatiq_pg_outbox.{schema[:27]}"
    assert len(digest) == 16 and int(digest, 16) >= 0


def test_long_schemas_that_share_their_first_characters_get_different_channels() -> None:
    common = "tenant_" + "a" * 40
    channels = {channel_for(common + suffix) for suffix in ("1", "2", "_x", "_xyzzy_" + "b" * 9)}
    assert len(channels) == 4
    # A shortened channel never equals the channel of a short schema.
    assert all(c.count(".") == 2 for c in channels)


@pytest.mark.slow
def test_a_63_character_schema_is_migrated_and_its_worker_is_woken_by_notify(
    database_url: str, db: Any
) -> None:
    # Given: a schema with the longest name PostgreSQL allows, migrated
    schema = "outbox_of_a_very_long_tenant_name_" + "x" * 29
    assert len(schema) == 63
    upgrade(database_url, schema=schema)
    broker = PostgresBroker(
        url=database_url,
        schema=schema,
        # An idle consumer polls only every 10 minutes: a prompt delivery needs NOTIFY.
        max_fetch_interval=600_000,
        heartbeat_interval=200,
        heartbeat_timeout=1_000,
        rescue_interval=300,
    )
    seen: queue.Queue[str] = queue.Queue()

    @dramatiq.actor(broker=broker, queue_name="long_schema")
    def task(key: str) -> None:
        seen.put(key)

    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        # And: the worker took a first message and its listener is on the channel
        task.send("first")
        assert seen.get(timeout=60) == "first"
        listener = broker.runtime.listener
        assert listener is not None and listener.connected.wait(30)
        # When: a second message is sent, long before the next poll
        task.send("second")
        # Then: it is processed, and the NOTIFY reached the listener
        assert seen.get(timeout=60) == "second"
        wait_for(lambda: listener.received >= 1, 30, "a notification on the shortened channel")
        assert len(broker.channel.encode()) <= MAX_CHANNEL_BYTES
    finally:
        worker.stop(timeout=5_000)
        broker.close()
        db.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


# -- passwords never reach a repr, a log line or an error message --

SECRET = "s3cret-in-query"
SSL_SECRET = "k3y-passphrase"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app@db.example:5432/app?password={SECRET}&sslpassword={SSL_SECRET}",
        f"postgresql+psycopg://app:{SECRET}@db.example/app?sslmode=verify-full&sslpassword={SSL_SECRET}",
    ],
)
def test_passwords_in_the_url_or_its_query_are_masked_in_the_brokers_repr(url: str) -> None:
    for broker in (PostgresBroker(url=url), PostgresBroker(engine=create_engine(url))):
        shown = f"{broker!r} {broker.safe_url}"
        assert SECRET not in shown and SSL_SECRET not in shown
        assert "***" in shown and "db.example" in shown


def test_a_query_password_is_masked_in_schema_not_ready_and_in_the_logs(
    database_url: str, caplog: pytest.LogCaptureFixture, db: Any
) -> None:
    # Given: a broker on a schema that was never migrated, with ?password= in its URL
    # (the test server ignores the password or accepts it; either way the schema is missing)
    caplog.set_level(logging.DEBUG)
    parsed = make_url(database_url)
    secret = str(parsed.password or SECRET)
    url = parsed.set(password=None).update_query_dict({"password": secret})
    broker = PostgresBroker(url=url, schema="never_migrated_q")

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    # When: a message is sent
    with pytest.raises(SchemaNotReady) as excinfo:
        task.send()
    broker.close()
    # Then: the error names the database and the fix, without the password
    message = str(excinfo.value)
    assert "dramatiq-pg-outbox migrate" in message and "password=***" in message
    assert secret not in message
    assert secret not in repr(broker)
    assert secret not in caplog.text


@pytest.mark.parametrize(
    "url",
    [f"mysql://root:{SECRET}@db/app", f"mysql://root@db/app?password={SECRET}&sslpassword={SSL_SECRET}"],
)
def test_a_non_postgres_url_is_refused_without_showing_its_password(url: str) -> None:
    for call in (lambda: PostgresBroker(url=url), lambda: upgrade(url), lambda: libpq_url(url)):
        with pytest.raises(ValueError, match="Not a PostgreSQL URL") as excinfo:
            call()
        assert SECRET not in str(excinfo.value) and SSL_SECRET not in str(excinfo.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            f"jdbc:postgresql://app:{SECRET}@db:5432/app?sslmode=require",
            "jdbc:postgresql://app:***@db:5432/app?sslmode=require is a JDBC URL; write it without "
            "'jdbc:', as libpq takes it: postgresql://app:***@db:5432/app?sslmode=require",
        ),
        (
            f"JDBC:postgresql://db/app?user=app&password={SECRET}",
            "JDBC:postgresql://db/app?user=app&password=*** is a JDBC URL; write it without 'jdbc:', "
            "as libpq takes it: postgresql://db/app?user=app&password=***",
        ),
        (
            "jdbc:postgresql:app",
            "jdbc:postgresql:app is a JDBC URL; write it as libpq takes it: "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE",
        ),
    ],
)
def test_a_jdbc_url_is_refused_with_its_libpq_form_without_its_password(url: str, expected: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        libpq_url(url)
    assert str(excinfo.value) == expected and SECRET not in str(excinfo.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            f"postgresql://u@h/db?sslpassword={SSL_SECRET}&sslmode=require",
            "postgresql://u@h/db?sslpassword=***&sslmode=require",
        ),
        (f"postgresql://u:{SECRET}@h/db?password={SECRET}", "postgresql://u:***@h/db?password=***"),
    ],
)
def test_mask_password_hides_ssl_key_passphrases_too(text: str, expected: str) -> None:
    assert mask_password(text) == expected


def test_mask_password_hides_an_ssl_key_passphrase_in_a_conninfo_string() -> None:
    masked = mask_password(f"host=h sslpassword={SSL_SECRET} dbname=db")
    assert conninfo_to_dict(masked) == {"host": "h", "sslpassword": "***", "dbname": "db"}


# -- the libpq URL keeps every character of the credentials, the database and the options --

#: Passwords that a URL must percent-encode, or that an encoder may get wrong.
AWKWARD_PASSWORDS = [
    "pass word",
    "p@ss",
    "pa/ss",
    "100%",
    "%20",
    "pa#ss",
    "pa?ss",
    "pa:ss",
    "pa+ss",
    "a&b=c",
    "[pa]ss",
    "back\\slash",
    "quo'te\"s",
    "pässwörd€",
    "pässwörd €",
    " leading and trailing ",
]


@pytest.mark.parametrize("password", AWKWARD_PASSWORDS)
@pytest.mark.parametrize("user", ["app", "user name@corp:x+y"])
def test_libpq_url_keeps_every_character_of_the_user_and_password(user: str, password: str) -> None:
    # Given: the same credentials as a SQLAlchemy URL object and as a percent-encoded URL string
    built = URL.create("postgresql+psycopg", user, password, "db.example", 5432, "app")
    written = f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@db.example:5432/app"
    assert make_url(written).password == password
    for url in (built, written):
        # When: it is turned into the libpq URL that psycopg connects with
        conninfo = libpq_url(url)
        # Then: libpq reads back the same user and password, and the rest unchanged
        params = conninfo_to_dict(conninfo)
        assert (params["user"], params["password"]) == (user, password), conninfo
        assert (params["host"], params["port"], params["dbname"]) == ("db.example", "5432", "app")
        # and so does the broker, which refused such a URL at construction before
        assert conninfo_to_dict(PostgresBroker(url=url).conninfo)["password"] == password


@pytest.mark.parametrize(
    ("parameter", "value"),
    [
        ("dbname", "my db"),
        ("dbname", "a+b/c%d"),
        ("application_name", "nightly batch"),
        ("application_name", "a+b"),
        ("options", "-c statement_timeout=5s -c search_path=app"),
        ("sslrootcert", "/etc/ssl/my certs/root.crt"),
    ],
)
def test_libpq_url_keeps_spaces_and_pluses_in_the_database_name_and_the_query(
    parameter: str, value: str
) -> None:
    if parameter == "dbname":
        url = URL.create("postgresql", "app", None, "db.example", None, value)
    else:
        url = URL.create("postgresql", "app", None, "db.example", None, "app", {parameter: value})
    conninfo = libpq_url(url)
    assert conninfo_to_dict(conninfo)[parameter] == value, conninfo


def test_a_password_libpq_cannot_take_is_refused_without_showing_it_even_percent_encoded() -> None:
    # Given: a password with a NUL byte, which libpq refuses even percent-encoded (%00), and an '@'
    password = "s3cret@\x00pw"
    url = URL.create("postgresql", "app", password, "db.example", None, "app")
    # When: a broker is built with it
    with pytest.raises(ValueError, match="libpq refuses the URL") as excinfo:
        PostgresBroker(url=url)
    # Then: the error names neither the password nor its percent-encoded form
    message = str(excinfo.value)
    assert "s3cret" not in message and "***" in message
