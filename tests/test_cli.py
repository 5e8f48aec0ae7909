"""The operators' command line: one clear line per expected failure, tables people can read.

Error cases run the CLI as a real process (``python -m dramatiq_pg_outbox.cli``,
cwd = the repository, so this checkout's code runs) and check the exit code,
that standard error is exactly one line, that it holds no traceback and no
password, and that it says what to do.  Output formats run ``main([...])``
in-process against the test database, with dead letters made by real workers.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import dramatiq
import psycopg
import pytest
from alembic.script import ScriptDirectory
from psycopg import sql
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox._runtime import format_error
from dramatiq_pg_outbox.cli import main
from dramatiq_pg_outbox.formats import exception_line
from dramatiq_pg_outbox.migrations import SCHEMA_REVISION, script_location
from dramatiq_pg_outbox.testing import ThrowawayPostgres
from tests.helpers import drop_past_history_partitions

ROOT = Path(__file__).resolve().parent.parent
#: Every subcommand that reads or writes the broker's tables, with its required arguments.  The
#: servers (dashboard, metrics, relay, scheduler) check the database before they serve.
TABLE_COMMANDS = [
    ["status"],
    ["failed"],
    ["retry-failed"],
    ["prune", "--older-than", "30"],
    ["maintain"],
    ["dashboard", "--port", "0"],
    ["metrics"],
    ["relay", "--to", "redis://127.0.0.1:1", "--queues", "emails"],
    ["scheduler", "--app", "tests.periodic_app"],
    ["schedules"],
]
#: The same plus migrate: every subcommand of ``dramatiq-pg-outbox --help``.
ALL_COMMANDS = [["migrate"], *TABLE_COMMANDS]
#: Background maintenance ticks once at start, then the test drives it by hand.
MANUAL = {"heartbeat_interval": 600_000, "heartbeat_timeout": 1_200_000, "rescue_interval": 600_000}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``dramatiq-pg-outbox ARGS`` as a process, without the caller's $DATABASE_URL.

    ``scheduler`` writes where its ``--app``'s broker does: tests/periodic_app.py builds that broker
    from $DPO_TEST_URL and $DPO_SCHEMA, set here to the ``--url`` (or $DATABASE_URL) and the
    ``--schema`` of ARGS, so that the scheduler meets the database every other subcommand meets.
    """
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DRAMATIQ_PG_OUTBOX_DEBUG")}
    app: dict[str, str] = {}
    if "scheduler" in args:
        url = option(args, "--url") or (env or {}).get("DATABASE_URL")
        app = {"DPO_TEST_URL": url} if url is not None else {}
        schema = option(args, "--schema")
        if schema is not None:
            app["DPO_SCHEMA"] = schema
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_outbox.cli", *args],
        cwd=ROOT,
        env={**clean, **app, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def option(args: Sequence[str], name: str) -> str | None:
    """The value of option ``name`` in ``args`` (the last one), or None."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    return values[-1] if values else None


def one_line_error(
    result: subprocess.CompletedProcess[str], exit_code: int, *, says: Sequence[str], hides: str = ""
) -> str:
    """Check the shape of an error report and return its line."""
    assert result.returncode == exit_code, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    if hides:
        assert hides not in result.stderr + result.stdout
    for text in says:
        assert text in lines[0], lines[0]
    return lines[0]


def with_credentials(url: str, user: str, password: str | None = None, database: str | None = None) -> str:
    parsed = make_url(url).set(username=user, password=password)
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


def random_name(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(4)}"


@pytest.fixture
def closed_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def password_server() -> Iterator[tuple[ThrowawayPostgres, str, str]]:
    """A private server that checks passwords (scram) for every role but postgres: (server, role, password).

    The shared test server trusts 127.0.0.1, where no password is ever checked.
    """
    try:
        server = ThrowawayPostgres()
    except RuntimeError as e:
        pytest.skip(f"no local PostgreSQL binaries for a password-checking server: {e}")
    role, password = random_name("cli_role"), secrets.token_urlsafe(16)
    with server:
        (server.data_dir / "pg_hba.conf").write_text(
            "local all postgres trust\n"
            "host all postgres 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
        )
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
            conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        yield server, role, password
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {role}")


@pytest.fixture
def old_schema(database_url: str) -> Iterator[str]:
    """A scratch schema migrated to revision 0002 only."""
    schema = random_name("cli_old")
    upgrade(database_url, schema=schema, revision="0002")
    yield schema
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


# -- errors: one line, an exit code, what to do ---------------------------------------------


@pytest.mark.parametrize("command", [c for c in ALL_COMMANDS if c != ["metrics"]], ids=lambda c: c[0])
def test_an_unreachable_server_is_one_line_for_every_subcommand(closed_port: int, command: list[str]) -> None:
    # (metrics starts anyway and reports the database down: tests/test_metrics.py)
    # Given a URL whose port nothing listens on
    url = f"postgresql://postgres:S3cret-pw@127.0.0.1:{closed_port}/postgres"
    # When any subcommand runs
    result = cli(*command, "--url", url)
    # Then one line names the server and what to check
    one_line_error(
        result,
        1,
        says=[f"127.0.0.1:{closed_port}", "connection refused", "Check that PostgreSQL is running"],
        hides="S3cret-pw",
    )


def test_a_wrong_password_is_one_line_without_the_password(
    password_server: tuple[ThrowawayPostgres, str, str],
) -> None:
    server, role, _ = password_server
    wrong = secrets.token_urlsafe(16)
    url = with_credentials(server.url, role, wrong)
    for command in ALL_COMMANDS:
        result = cli(*command, "--url", url)
        one_line_error(
            result,
            1,
            says=[
                f"refused user {role!r}",
                "password authentication failed",
                "Check the user name and password",
            ],
            hides=wrong,
        )


def test_a_password_that_the_url_must_percent_encode_logs_in(
    password_server: tuple[ThrowawayPostgres, str, str],
) -> None:
    # Given a role whose password has a space, '@', '/', '%', '#', '?', ':', '+' and non-ASCII letters,
    # written percent-encoded in the URL as RFC 3986 asks
    server, _, _ = password_server
    role, password = random_name("cli_awkward"), f"p w@/%#?:+ä€{secrets.token_hex(4)}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(password))
        )
    try:
        url = make_url(server.url).set(username=role, password=None).render_as_string()
        url = url.replace(f"{role}@", f"{role}:{quote(password, safe='')}@", 1)
        assert make_url(url).password == password
        # When the broker and the CLI connect with it
        with psycopg.connect(PostgresBroker(url=url).conninfo) as conn:
            # Then the server checked that password and let the role in
            assert conn.execute("SELECT current_user").fetchone() == (role,)
        # (the CLI gets as far as the missing tables, so it logged in, and shows no password)
        result = cli("status", "--url", url, "--schema", random_name("cli_none"))
        one_line_error(result, 1, says=["tables do not exist"], hides=password)
    finally:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_unknown_role_is_one_line_naming_it(database_url: str) -> None:
    role = random_name("cli_nobody")
    result = cli("status", "--url", with_credentials(database_url, role, "S3cret-pw"))
    # A trusting server says the role does not exist, a password-checking one that
    # authentication failed: either way the line names the user to check.
    one_line_error(result, 1, says=[f"refused user {role!r}", "Check the user name"], hides="S3cret-pw")


def test_an_unknown_database_is_one_line_naming_it(database_url: str) -> None:
    name = random_name("cli_nodb")
    parsed = make_url(database_url)
    url = with_credentials(database_url, parsed.username or "postgres", parsed.password, database=name)
    result = cli("failed", "--url", url)
    one_line_error(result, 1, says=[f"has no database {name!r}", f"createdb {name}"])


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:S3cret-pw@db.example:notaport/app",
        "postgresql://u:S3cret-pw@extra@db.example/app",
        "postgresql://u@db.example/app?password=S3cret-pw&nosuchparameter=1",
        "just some words",
    ],
)
def test_an_unparsable_url_is_a_usage_error_without_the_password(url: str) -> None:
    result = cli("status", "--url", url)
    one_line_error(
        result, 2, says=["URL", "postgresql://USER:PASSWORD@HOST:PORT/DATABASE"], hides="S3cret-pw"
    )


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: c[0])
def test_an_unparsable_url_is_a_usage_error_for_every_subcommand(command: list[str]) -> None:
    # Given a URL whose port is not a number
    url = "postgresql://u:S3cret-pw@db.example:notaport/app"
    # When any subcommand is given it
    result = cli(*command, "--url", url)
    # Then it is refused before anything else, in one line that shows the expected shape
    one_line_error(
        result,
        2,
        says=[
            f"dramatiq-pg-outbox {command[0]}: error: cannot parse the database URL of --url",
            "expected postgresql://USER:PASSWORD@HOST:PORT/DATABASE",
        ],
        hides="S3cret-pw",
    )


def test_a_url_of_another_database_is_a_usage_error() -> None:
    result = cli("status", "--url", "mysql://u:S3cret-pw@db.example/app")
    one_line_error(
        result, 2, says=["not a PostgreSQL URL", "mysql://u:***@db.example/app"], hides="S3cret-pw"
    )


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: c[0])
def test_an_invalid_schema_name_is_a_usage_error(database_url: str, command: list[str]) -> None:
    # Given a schema name that could not be an identifier
    # When any subcommand is given it
    result = cli(*command, "--url", database_url, "--schema", "bad name;")
    # Then argparse refuses it in one line that points at the subcommand's help
    one_line_error(result, 2, says=["--schema", "Invalid schema name 'bad name;'", f"{command[0]} --help"])


@pytest.mark.parametrize(
    ("args", "rule"),
    [
        (["failed", "--limit", "0"], "must be 1 or more"),
        (["failed", "--limit", "-5"], "must be 1 or more"),
        (["prune", "--older-than", "0"], "must be more than 0"),
        (["prune", "--older-than", "-3"], "must be more than 0"),
        (["prune", "--older-than", "30", "--lock-timeout", "0"], "must be 1 or more"),
        (["retry-failed", "--id", "0"], "must be 1 or more"),
        (["retry-failed", "--id", "-1"], "must be 1 or more"),
        (["maintain", "--days-ahead", "-1"], "must be within 0..3660"),
        (["dashboard", "--port", "-1"], "port must be 0-65535"),
        (["metrics", "--cache-seconds", "-1"], "must be 0 or more"),
        (["metrics", "--heartbeat-timeout", "0"], "must be 1 or more"),
        (["relay", "--to", "redis://127.0.0.1:1", "--queues", "q", "--batch-size", "0"], "must be 1 or more"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_negative_or_zero_limits_are_usage_errors(database_url: str, args: list[str], rule: str) -> None:
    result = cli(*args, "--url", database_url)
    limit = next(arg for arg in reversed(args) if arg.startswith("--"))
    one_line_error(result, 2, says=[f"dramatiq-pg-outbox {args[0]}: error: argument {limit}", rule])


@pytest.mark.parametrize(
    "args",
    [
        ["metrics", "--cache-seconds", "inf"],
        ["metrics", "--cache-seconds", "nan"],
        ["metrics", "--cache-seconds", "1e400"],
        ["relay", "--to", "redis://127.0.0.1:1", "--queues", "q", "--report-every", "inf"],
        ["relay", "--to", "redis://127.0.0.1:1", "--queues", "q", "--report-every", "NaN"],
    ],
    ids=" ".join,
)
def test_infinite_or_nan_seconds_are_usage_errors(database_url: str, args: list[str]) -> None:
    # Given a number of seconds that float() accepts but no timer can wait
    # When the subcommand is given it
    result = cli(*args, "--url", database_url)
    # Then it is refused as a usage error before any connection
    one_line_error(
        result,
        2,
        says=[
            f"dramatiq-pg-outbox {args[0]}: error: argument {args[-2]}",
            f"expected a finite number, got {args[-1]!r}",
        ],
    )


@pytest.mark.parametrize(
    "command", [c for c in ALL_COMMANDS if c[0] != "scheduler"], ids=lambda c: c[0]
)  # the scheduler's database is its --app's broker's
def test_a_missing_url_is_a_usage_error(command: list[str]) -> None:
    result = cli(*command)
    one_line_error(result, 2, says=[f"{command[0]}: error: no database URL", "--url", "DATABASE_URL"])


@pytest.mark.parametrize("command", TABLE_COMMANDS, ids=lambda c: c[0])
def test_a_missing_schema_names_the_migrate_command(database_url: str, command: list[str]) -> None:
    # Given a schema that was never migrated
    schema = random_name("cli_missing")
    # When a subcommand reads it
    result = cli(*command, "--url", database_url, "--schema", schema)
    # Then the line names the exact command that creates it
    one_line_error(
        result,
        1,
        says=[
            "tables do not exist",
            f"Run: dramatiq-pg-outbox migrate --url {database_url} --schema {schema}",
        ],
    )


@pytest.mark.parametrize("command", TABLE_COMMANDS, ids=lambda c: c[0])
def test_an_old_schema_names_the_migrate_command(
    database_url: str, old_schema: str, command: list[str]
) -> None:
    # Given a schema at revision 2
    # When a subcommand reads it
    result = cli(*command, "--url", database_url, "--schema", old_schema)
    # Then the line names the revision needed and the exact command that upgrades it
    # (the dashboard reads revision 3 and later: see tests/test_dashboard.py)
    needs = "the dashboard needs 3 or later" if command[0] == "dashboard" else "this version needs"
    one_line_error(
        result,
        1,
        says=[
            f"is at revision 2, {needs}",
            f"{SCHEMA_REVISION}",
            f"Run: dramatiq-pg-outbox migrate --url {database_url} --schema {old_schema}",
        ],
    )


def test_migrate_refuses_tables_that_an_application_history_manages(database_url: str) -> None:
    # Given tables created through an application's own alembic history (no version table of ours)
    schema = random_name("cli_app")
    upgrade(database_url, schema=schema)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{schema}".dramatiq_pg_outbox_version')
    try:
        # When migrate runs on them, then it says where to upgrade instead of failing on CREATE TABLE
        result = cli("migrate", "--url", database_url, "--schema", schema)
        one_line_error(result, 1, says=["already holds the tables", "alembic upgrade heads"])
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_passwords_are_masked_in_the_url_and_the_fix_command(
    password_server: tuple[ThrowawayPostgres, str, str],
) -> None:
    # Given the right password, as user info, as a query parameter, and in $DATABASE_URL
    server, role, password = password_server
    in_userinfo = with_credentials(server.url, role, password)
    in_query = f"{with_credentials(server.url, role)}?password={password}"
    for args, env, fix in [
        # (a masked URL cannot be pasted: the command names the variable to set)
        (["--url", in_userinfo], None, '--url "$DATABASE_URL" --schema not_migrated (after setting'),
        (["--url", in_query], None, '--url "$DATABASE_URL" --schema not_migrated (after setting'),
        ([], {"DATABASE_URL": in_userinfo}, '--url "$DATABASE_URL"'),
    ]:
        # When the CLI connects and finds no tables
        result = cli("status", *args, "--schema", "not_migrated", env=env)
        # Then the line shows where and how to fix it, with the password masked
        one_line_error(result, 1, says=["***", fix, "--schema not_migrated"], hides=password)


def test_debug_shows_the_traceback_without_the_password(
    password_server: tuple[ThrowawayPostgres, str, str],
) -> None:
    server, role, _ = password_server
    wrong = secrets.token_urlsafe(16)
    url = with_credentials(server.url, role, wrong)
    for args, env in [
        (["status", "--debug", "--url", url], None),
        (["--debug", "status", "--url", url], None),
        (["status", "--url", url], {"DRAMATIQ_PG_OUTBOX_DEBUG": "1"}),
        *(([*command, "--debug", "--url", url], None) for command in ALL_COMMANDS),
    ]:
        result = cli(*args, env=env)
        command = next(arg for arg in args if not arg.startswith("-"))
        assert result.returncode == 1, result
        assert "Traceback (most recent call last):" in result.stderr, result
        assert "psycopg.OperationalError" in result.stderr
        assert wrong not in result.stderr
        assert result.stderr.splitlines()[-1].startswith(f"dramatiq-pg-outbox {command}: error: "), result


def test_retry_failed_of_an_id_that_is_no_dead_letter_fails_naming_it(database_url: str, db: Any) -> None:
    result = cli("retry-failed", "--url", database_url, "--id", "987654")
    assert result.stdout == "re-enqueued 0 failed message(s)\n"
    one_line_error(
        result, 1, says=["no dead letter with id 987654", "dramatiq-pg-outbox failed --schema dramatiq --url"]
    )


# -- output --------------------------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(list(args)) == 0
    out = capsys.readouterr().out
    # Never Python reprs of lists or timedeltas.
    assert not re.search(r"\[|\]|datetime|timedelta|day,", out), out
    return out.splitlines()


def test_status_prints_queues_dead_letters_and_workers_as_tables(
    database_url: str,
    make_broker: Any,
    start_worker: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a dead letter, a delayed message and a live worker on two queues
    broker = make_broker()

    @dramatiq.actor(broker=broker, max_retries=0)
    def charge(customer: str) -> None:
        raise KeyError(customer)

    @dramatiq.actor(broker=broker, queue_name="later")
    def remind() -> None:
        pass

    charge.send("no such customer")
    remind.send_with_options(delay=3_600_000)
    start_worker(broker)
    broker.join("default", timeout=20_000)
    maintenance = broker.runtime.maintenance
    assert maintenance is not None
    maintenance.heartbeat()  # the workers row lists every queue consumed by now
    # When status runs
    lines = run(capsys, "status", "--url", database_url)
    # Then each part is a table with a header
    assert re.match(r"^queue\s+state\s+messages\s+delayed\s+oldest$", lines[0]), lines
    assert any(re.match(r"^later\s+pending\s+1\s+1\s+\d+(\.\d)? s$", line) for line in lines), lines
    assert any(re.match(r"^queue\s+failed last hour\s+failed in history$", line) for line in lines), lines
    assert any(re.match(r"^default\s+1\s+1$", line) for line in lines), lines
    assert any(re.match(r"^host\s+pid\s+queues\s+last heartbeat$", line) for line in lines), lines
    worker = [line for line in lines if re.search(rf"\s{os.getpid()}\s", line)]
    assert len(worker) == 1, lines
    assert re.search(r"\s(default, later|later, default)\s+\d+(\.\d)? s ago$", worker[0]), worker
    assert worker[0].startswith(socket.gethostname())


def test_status_of_an_empty_database_says_so(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "status", "--url", database_url) == [
        "no messages waiting or running in schema 'dramatiq'",
        "",
        "no dead letters",
        "",
        "no workers",
    ]


def test_failed_shows_the_exception_line_not_the_traceback(
    database_url: str,
    make_broker: Any,
    start_worker: Any,
    db: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a dead letter whose actor raised, and one quarantined after max_deliveries
    broker = make_broker(max_deliveries=1, **MANUAL)

    @dramatiq.actor(broker=broker, max_retries=0)
    def charge(customer: str) -> None:
        raise KeyError(customer)

    @dramatiq.actor(broker=broker, queue_name="crashes")
    def crash() -> None:
        pass

    crash.send()
    consumer = broker.consume("crashes", prefetch=1, timeout=2_000)
    assert next(consumer) is not None
    maintenance = broker.runtime.maintenance
    assert maintenance is not None and maintenance.ticked.wait(10)
    consumer.close()  # it holds the claimed message: close hands back only unstarted ones
    db.execute("UPDATE dramatiq.messages SET owner = %s", (uuid.uuid4(),))  # its worker "died"
    assert maintenance.rescue().quarantined == 1
    charge.send("no such customer")
    start_worker(broker, queues={"default"})
    broker.join("default", timeout=20_000)
    assert db.execute("SELECT count(*) FROM dramatiq.history WHERE state = 'failed'").fetchone()[0] == 2
    # When failed runs on a wide terminal
    monkeypatch.setenv("COLUMNS", "250")
    lines = run(capsys, "failed", "--url", database_url)
    # Then each row shows the exception line, newest first
    assert re.match(r"^\s*id\s+queue\s+actor\s+attempts\s+finished\s+error$", lines[0])
    assert re.search(r"\sdefault\s+charge\s+1\s.*\sKeyError: 'no such customer'$", lines[1]), lines
    assert re.search(
        r"\scrashes\s+crash\s+1\s.*\sMaxDeliveriesExceeded: quarantined: .*max_deliveries=1", lines[2]
    )
    assert len(lines) == 3
    # And --queue and --limit choose the rows
    assert len(run(capsys, "failed", "--url", database_url, "--queue", "crashes")) == 2
    assert len(run(capsys, "failed", "--url", database_url, "--limit", "1")) == 2


def test_failed_clips_long_exception_lines_to_the_terminal(
    database_url: str,
    broker: PostgresBroker,
    start_worker: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @dramatiq.actor(broker=broker, max_retries=0)
    def shout() -> None:
        raise ValueError("x" * 500)

    shout.send()
    start_worker(broker)
    broker.join("default", timeout=20_000)
    monkeypatch.setenv("COLUMNS", "100")
    lines = run(capsys, "failed", "--url", database_url)
    assert len(lines) == 2
    assert len(lines[1]) <= 100
    assert re.search(r"\sValueError: x{10,}\.\.\.$", lines[1]), lines


def test_migrate_prints_the_revision_it_reached(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = random_name("cli_migrate")
    (head,) = ScriptDirectory(script_location()).get_heads()
    try:
        assert run(capsys, "migrate", "--url", database_url, "--schema", schema, "--revision", "0002") == [
            f"schema {schema!r} is at revision 0002, created"
        ]
        assert run(capsys, "migrate", "--url", database_url, "--schema", schema) == [
            f"schema {schema!r} is at revision {head} (head), upgraded from 0002"
        ]
        assert run(capsys, "migrate", "--url", database_url, "--schema", schema) == [
            f"schema {schema!r} is at revision {head} (head), already current"
        ]
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_migrate_sql_prints_the_sql_from_an_empty_schema_when_the_url_reaches_no_server(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["migrate", "--sql", "--schema", "jobs", "--url", "postgresql://u@127.0.0.1:1/x"]) == 0
    printed = capsys.readouterr()
    assert 'CREATE TABLE "jobs".messages' in printed.out
    assert "connection refused" in printed.err and "; printing the SQL from an empty schema" in printed.err
    assert "(the database could not be reached)" in printed.out


def dead_letter(broker: PostgresBroker, start_worker: Any, db: Any) -> tuple[int, Any]:
    """Run an actor that fails on a worker until it is a dead letter: (its history id, the worker)."""

    @dramatiq.actor(broker=broker, max_retries=0)
    def boom() -> None:
        raise RuntimeError("boom")

    boom.send()
    worker = start_worker(broker)
    broker.join("default", timeout=20_000)
    (row_id,) = db.execute("SELECT id FROM dramatiq.history WHERE state = 'failed'").fetchone()
    return int(row_id), worker


def test_retry_failed_and_prune_report_counts(
    database_url: str, broker: PostgresBroker, start_worker: Any, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    drop_past_history_partitions(db)  # another test's old partitions would be counted
    row_id, _ = dead_letter(broker, start_worker, db)
    assert run(capsys, "retry-failed", "--url", database_url, "--id", str(row_id)) == [
        "re-enqueued 1 failed message(s)"
    ]
    broker.join("default", timeout=20_000)
    db.execute("UPDATE dramatiq.history SET finished_at = now() - interval '2 days'")
    assert run(capsys, "prune", "--url", database_url, "--older-than", "36h") == [
        "dropped 0 day partition(s) of about 0 row(s), deleted 1 history row(s) older than 1 d 12 h, "
        "freed 0 idempotency key(s)"
    ]


def test_retry_failed_wakes_the_workers_of_the_queue_as_the_dashboard_does(
    database_url: str, broker: PostgresBroker, start_worker: Any, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a dead letter and a connection listening on the broker's channel
    row_id, worker = dead_letter(broker, start_worker, db)
    worker.stop()
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        # When the CLI puts it back on its queue
        assert run(capsys, "retry-failed", "--url", database_url, "--id", str(row_id)) == [
            "re-enqueued 1 failed message(s)"
        ]
        # Then the workers of that queue are woken at once (not at their next poll)
        payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert payloads == ["default"]


# -- the exception line of a stored error ------------------------------------------------------------


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        return e


class CustomerMissing(Exception):
    pass


def test_the_exception_line_of_a_chained_traceback_is_the_last_exception() -> None:
    try:
        try:
            {}["a"]
        except KeyError as e:
            raise CustomerMissing("customer 7\nhas no address") from e
    except CustomerMissing as e:
        kind, text = format_error(e)
    assert text.startswith("Traceback (most recent call last):")
    assert exception_line(kind, text) == "tests.test_cli.CustomerMissing: customer 7"


def test_the_exception_line_of_an_error_text_is_its_type_and_first_line() -> None:
    assert exception_line("DecodeError", format_error(raised(ValueError("bad json")))[1]) == (
        "DecodeError: ValueError: bad json"
    )
    assert exception_line("Unknown", format_error(None)[1]) == (
        "Unknown: the message failed without an exception (for example, it was skipped)"
    )
    assert exception_line(None, None) == ""
