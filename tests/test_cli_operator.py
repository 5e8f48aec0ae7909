"""The command line as an operator's tool: ``--version``, ``status --check``, ``workers``,
``schedules --json``, ``pause`` of an unknown queue, a closed pipe, a password on the command line.

In-process runs (``main([...])``) check the output; real processes check exit codes, the
pipe and what another user would see.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox.cli import main
from dramatiq_pg_outbox.cli.common import EXIT_ATTENTION, EXIT_BROKEN_PIPE, EXIT_USAGE, package_version

from .test_cli import ROOT, cli, one_line_error


def run(capsys: pytest.CaptureFixture[str], *args: str, code: int = 0) -> str:
    assert main(list(args)) == code
    return capsys.readouterr().out


def add_dead_letter(db: Any, queue: str, hours_ago: float = 0) -> None:
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, "
        "enqueued_at, finished_at, error_type, error, payload) "
        "VALUES ((1e9 + floor(random() * 1e9))::bigint, %s, 'charge', gen_random_uuid()::text, "
        "'failed', 1, now(), now() - %s * interval '1 hour', 'KeyError', 'KeyError: x', '')",
        (queue, hours_ago),
    )


def add_due(db: Any, queue: str, n: int = 1) -> None:
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload) "
        "SELECT %s, 'charge', gen_random_uuid()::text, '' FROM generate_series(1, %s)",
        (queue, n),
    )


def add_worker(db: Any, queues: list[str], seconds_ago: float = 0) -> None:
    db.execute(
        "INSERT INTO dramatiq.workers (id, hostname, pid, queues, heartbeat_at) "
        "VALUES (gen_random_uuid(), 'box', 4242, %s, now() - %s * interval '1 second')",
        (queues, seconds_ago),
    )


def test_version_prints_the_package_version() -> None:
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"dramatiq-pg-outbox {package_version()}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", package_version())


def test_status_check_reports_only_what_needs_attention_and_exits_3(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given nothing wrong: an old dead letter, due messages of a queue that a live worker consumes
    add_dead_letter(db, "emails", hours_ago=3)
    add_due(db, "emails", 2)
    add_worker(db, ["emails", "emails.DQ"])
    assert run(capsys, "status", "--url", database_url, "--check") == (
        "ok: nothing needs attention in schema 'dramatiq'\n"
    )
    # When a dead letter is recent, a queue has due messages and only a silent worker, another
    # is paused with due messages, and an enabled schedule is late beyond its grace
    add_dead_letter(db, "emails", hours_ago=0.5)
    add_due(db, "reports", 3)
    add_worker(db, ["reports"], seconds_ago=600)
    add_due(db, "exports", 4)
    db.execute("INSERT INTO dramatiq.queue_pauses (queue_name) VALUES ('exports'), ('exports.DQ')")
    db.execute(
        "INSERT INTO dramatiq.schedules (name, actor_name, queue_name, every_ms, grace_ms, next_run_at, "
        "disabled_at) VALUES ('nightly', 'charge', 'emails', 60000, 60000, now() - interval '10 minutes', "
        "NULL), ('off', 'charge', 'emails', 60000, 60000, now() - interval '1 day', now())"
    )
    out = run(capsys, "status", "--url", database_url, "--check", code=EXIT_ATTENTION)
    # Then each problem is one line, and the paused queue and the disabled schedule are not
    lines = out.splitlines()
    assert (
        lines[0]
        == "queue 'emails': 1 dead letter(s) in the last hour (see: dramatiq-pg-outbox failed --queue emails)"
    )
    assert lines[1] == "queue 'reports': 3 due message(s) and no live worker consumes it"
    assert re.fullmatch(
        r"schedule 'nightly': its tick is 10 min \d\d s overdue: is a scheduler running\?", lines[2]
    )
    assert len(lines) == 3
    # And --json carries the same lines, with the same exit code
    report = json.loads(
        run(capsys, "status", "--url", database_url, "--check", "--json", code=EXIT_ATTENTION)
    )
    assert report["attention"] == lines
    assert {w["live"] for w in report["workers"]} == {True, False}
    # And as a process (for cron): exit 3
    assert cli("status", "--url", database_url, "--check").returncode == EXIT_ATTENTION


def test_workers_lists_each_process_live_or_silent(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "workers", "--url", database_url) == "no workers in schema 'dramatiq'\n"
    add_worker(db, ["emails", "emails.DQ"])
    add_worker(db, ["reports"], seconds_ago=90)
    lines = run(capsys, "workers", "--url", database_url).splitlines()
    assert re.match(r"^host\s+pid\s+queues\s+last heartbeat\s+status$", lines[0])
    assert sum(bool(re.search(r"\semails\s+\d+(\.\d)? s ago\s+live$", line)) for line in lines) == 1
    assert sum(line.endswith("silent: counted dead") for line in lines) == 1
    listed = json.loads(run(capsys, "workers", "--url", database_url, "--json"))["workers"]
    assert sorted((w["queues"], w["live"]) for w in listed) == [
        (["emails", "emails.DQ"], True),
        (["reports"], False),
    ]
    # A longer timeout counts the silent one as live
    listed = json.loads(
        run(capsys, "workers", "--url", database_url, "--json", "--heartbeat-timeout", "600000")
    )
    assert all(w["live"] for w in listed["workers"])


def test_schedules_json_gives_each_schedule_and_its_status(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    db.execute(
        "INSERT INTO dramatiq.schedules (name, actor_name, queue_name, every_ms, next_run_at) VALUES "
        "('json_beat', 'ping', 'default', 60000, now() + interval '30 seconds'), "
        "('json_late', 'ping', 'default', 60000, now() - interval '1 hour')"
    )
    listed = json.loads(run(capsys, "schedules", "--url", database_url, "--json"))["schedules"]
    by_name = {s["name"]: s for s in listed}
    beat, late = by_name["json_beat"], by_name["json_late"]
    assert (beat["status"], late["status"]) == ("ok", "late")
    assert beat["late_seconds"] == 0 and late["late_seconds"] >= 3600
    assert beat["every_ms"] == 60000 and beat["next_run_at"].endswith("+00:00")


def test_pause_refuses_a_queue_nothing_has_named_unless_create(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a queue known by its messages, and one known only from history
    add_due(db, "emails")
    add_dead_letter(db, "archive", hours_ago=48)
    # When a typo is paused: one line, exit 2, nothing paused
    result = cli("pause", "emials", "--url", database_url)
    one_line_error(
        result, EXIT_USAGE, says=["no message, worker or schedule has named queue 'emials'", "--create"]
    )
    assert db.execute(
        "SELECT count(*) FROM dramatiq.queue_pauses WHERE queue_name LIKE 'emials%'"
    ).fetchone() == (0,)
    # Then known queues pause, and --create pauses a new one
    assert run(capsys, "pause", "emails", "archive", "--url", database_url).count("paused queue") == 2
    assert "paused queue 'newq'" in run(capsys, "pause", "newq", "--create", "--url", database_url)
    paused = {r[0] for r in db.execute("SELECT queue_name FROM dramatiq.queue_pauses")}
    assert {"emails", "archive", "newq", "newq.DQ"} <= paused
    # (pauses outlive a test in this database: lift them)
    assert run(capsys, "resume", "emails", "archive", "newq", "--url", database_url).count("resumed") == 3


def test_a_reader_that_goes_away_ends_the_command_quietly(database_url: str, db: Any) -> None:
    # Given more dead letters than a pipe holds (each line of --json about 200 bytes)
    for _ in range(5):
        add_dead_letter(db, "emails")
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, "
        "enqueued_at, finished_at, error_type, error, payload) SELECT -1000 - i, 'emails', 'charge', "
        "i::text, 'failed', 1, now(), now(), 'KeyError', repeat('x', 500), '' "
        "FROM generate_series(1, 2000) AS i"
    )
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    # When its output is read by `head -1`
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dramatiq_pg_outbox.cli",
            "failed",
            "--json",
            "--limit",
            "2000",
            "--url",
            database_url,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    # Then it ends without a word, with the status of a process that SIGPIPE ended
    assert proc.wait(60) == EXIT_BROKEN_PIPE
    assert proc.stderr.read() == b""


def test_a_password_on_the_command_line_is_warned_about_without_showing_it(
    database_url: str, db: Any
) -> None:
    # (the shared test server trusts 127.0.0.1: the password is not checked, only seen in ps)
    url = make_url(database_url).set(password="hunter2-visible").render_as_string(hide_password=False)
    result = cli("status", "--url", url)
    assert result.returncode == 0
    (line,) = result.stderr.splitlines()
    assert "password given with --url can be read by every user" in line and "$DATABASE_URL" in line
    assert "hunter2" not in result.stderr + result.stdout
    # Through $DATABASE_URL there is nothing to warn about
    assert cli("status", env={"DATABASE_URL": url}).stderr == ""


def test_the_fix_for_an_unmigrated_database_can_be_pasted_when_the_url_has_a_password(
    database_url: str,
) -> None:
    # Given a database without the tables, named by a URL with a password
    url = make_url(database_url).set(password="hunter2-visible").render_as_string(hide_password=False)
    result = cli("status", "--url", url, "--schema", "never_migrated")
    line = one_line_error(result, 1, says=["tables do not exist"], hides="hunter2")
    # Then the command to run names the variable to set, not a masked URL
    command = line.split("Run: ", 1)[1]
    assert command.startswith('dramatiq-pg-outbox migrate --url "$DATABASE_URL" --schema never_migrated')
    assert "after setting DATABASE_URL to the URL" in command and "***" not in command
    # And it works as printed once the variable is set
    env = {"DATABASE_URL": url}
    # (dramatiq-pg-outbox as this checkout's module, whichever copy the console script points to)
    this_checkout = f'dramatiq-pg-outbox() {{ "{sys.executable}" -m dramatiq_pg_outbox.cli "$@"; }}; '
    pasted = subprocess.run(
        ["bash", "-c", this_checkout + command.split(" (after", 1)[0]],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert pasted.returncode == 0, pasted.stderr
        assert cli("status", "--schema", "never_migrated", env=env).returncode == 0
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS never_migrated CASCADE")


@pytest.mark.parametrize("parameter", ["sslmode=bogus", "target_session_attrs=nope"])
def test_a_url_parameter_libpq_refuses_is_a_usage_error(database_url: str, parameter: str) -> None:
    result = cli("status", "--url", f"{database_url}?{parameter}")
    name = parameter.split("=")[0]
    one_line_error(result, EXIT_USAGE, says=[f"has an invalid {name} value", "Fix it"])


def test_migrate_sql_starts_at_the_database_revision_and_brings_it_to_head(database_url: str) -> None:
    # Given a schema at revision 0014
    schema = "sql_from_0014"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    try:
        assert cli("migrate", "--url", database_url, "--schema", schema, "--revision", "0014").returncode == 0
        # When the SQL of its upgrade is printed
        result = cli("migrate", "--sql", "--url", database_url, "--schema", schema)
        assert result.returncode == 0, result.stderr
        upgrades = re.findall(r"^-- Running upgrade (\S+) -> (\S+)$", result.stdout, re.M)
        # Then it starts at 0014, not at the empty schema
        assert upgrades[0] == ("0014", "0015")
        assert result.stdout.startswith("-- dramatiq-pg-outbox migrate --sql: from revision 0014")
        # And run by psql, it brings the schema to head
        applied = subprocess.run(
            ["psql", "-v", "ON_ERROR_STOP=1", "-q", database_url],
            input=result.stdout,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert applied.returncode == 0, applied.stderr
        status = cli("migrate", "--url", database_url, "--schema", schema)
        assert "already current" in status.stdout, status
        # Without a URL, the SQL starts from an empty schema, as before
        offline = cli("migrate", "--sql", "--schema", schema)
        assert "-- Running upgrade  -> 0001" in offline.stdout
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


# -- the dashboard's buttons as subcommands ---------------------------------------------------------


def live(db: Any, queue: str) -> list[tuple[int, str]]:
    return [
        (int(i), str(s))
        for i, s in db.execute(
            "SELECT id, CASE WHEN next_attempt_at > now() THEN 'delayed' ELSE state END "
            "FROM dramatiq.messages WHERE queue_name = %s ORDER BY id",
            (queue,),
        )
    ]


def test_cancel_and_run_now_act_on_the_rows_the_dashboard_would(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given two due messages and a delayed one
    add_due(db, "jobs", 2)
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload, next_attempt_at) "
        "VALUES ('jobs', 'charge', gen_random_uuid()::text, '', now() + interval '1 hour')"
    )
    (first, _), (second, _), (later, _) = live(db, "jobs")
    # When one is canceled (a dry run first), and the delayed one made due
    out = run(capsys, "cancel", str(first), "--dry-run", "--url", database_url)
    assert out == f"would cancel message {first} of queue 'jobs': waiting, now in history as canceled\n" + (
        "dry run: nothing changed\n"
    )
    assert len(live(db, "jobs")) == 3
    assert run(capsys, "cancel", str(first), "--url", database_url).startswith(f"canceled message {first}")
    assert run(capsys, "run-now", str(later), "--url", database_url).startswith(f"made message {later}")
    # Then the canceled one is in history as canceled, naming who canceled it, and the other is due
    ((state, error_type, error),) = db.execute(
        "SELECT state, error_type, error FROM dramatiq.history WHERE id = %s", (first,)
    ).fetchall()
    assert (state, error_type) == ("canceled", "Canceled") and "with dramatiq-pg-outbox cancel" in error
    assert live(db, "jobs") == [(second, "pending"), (later, "pending")]
    # And a message that finished already, or that does not exist, is named, exit 1
    one_line_error(
        cli("cancel", str(first), "99999999", "--url", database_url),
        1,
        says=[f"message {first} already finished (canceled) at", "no message 99999999"],
    )
    one_line_error(cli("run-now", str(second), "--url", database_url), 1, says=["no delayed message"])


def test_purge_deletes_the_waiting_messages_of_one_queue(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    add_due(db, "bulk", 5)
    add_due(db, "other", 2)
    assert run(capsys, "purge", "bulk", "--dry-run", "--url", database_url).splitlines() == [
        "would delete 5 waiting message(s) of queue 'bulk' (running ones finish)",
        "dry run: nothing changed",
    ]
    assert len(live(db, "bulk")) == 5
    assert run(capsys, "purge", "bulk", "--url", database_url).startswith("deleted 5 waiting message(s)")
    assert (len(live(db, "bulk")), len(live(db, "other"))) == (0, 2)


def test_discard_deletes_dead_letters_for_good_by_id_or_by_queue(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    for queue in ("d1", "d1", "d2"):
        add_dead_letter(db, queue)
    ids = [
        int(r[0]) for r in db.execute("SELECT id FROM dramatiq.history WHERE queue_name = 'd1' ORDER BY id")
    ]
    assert "would delete 2 dead letter(s) for good (d1: 2)" in run(
        capsys, "discard", "--queue", "d1", "--dry-run", "--url", database_url
    )
    assert run(capsys, "discard", str(ids[0]), "--url", database_url).startswith("deleted 1 dead letter(s)")
    assert run(capsys, "discard", "--queue", "d1", "--url", database_url).startswith(
        "deleted 1 dead letter(s)"
    )
    remaining = db.execute("SELECT queue_name FROM dramatiq.history WHERE queue_name LIKE 'd_'").fetchall()
    assert remaining == [("d2",)]
    one_line_error(cli("discard", "--url", database_url), EXIT_USAGE, says=["name the dead letters"])
    one_line_error(cli("discard", str(ids[0]), "--url", database_url), 1, says=["only 0 of the 1 ids"])


def test_schedules_enable_and_disable_one(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    db.execute(
        "INSERT INTO dramatiq.schedules (name, actor_name, queue_name, every_ms, next_run_at) "
        "VALUES ('toggled', 'ping', 'default', 60000, now())"
    )
    assert (
        run(capsys, "schedules", "disable", "toggled", "--url", database_url)
        == "disabled schedule 'toggled'\n"
    )
    assert db.execute(
        "SELECT disabled_at IS NOT NULL FROM dramatiq.schedules WHERE name = 'toggled'"
    ).fetchone() == (True,)
    assert "already disabled" in run(capsys, "schedules", "disable", "toggled", "--url", database_url)
    assert (
        run(capsys, "schedules", "enable", "toggled", "--url", database_url) == "enabled schedule 'toggled'\n"
    )
    one_line_error(cli("schedules", "enable", "nope", "--url", database_url), 1, says=["no schedule 'nope'"])
    one_line_error(
        cli("schedules", "enable", "--url", database_url), EXIT_USAGE, says=["needs the schedule's NAME"]
    )


def test_a_role_without_the_grants_is_told_which_object_and_which_grant(database_url: str, db: Any) -> None:
    role = f"cli_nogrant_{os.getpid()}"
    db.execute(f"DROP ROLE IF EXISTS {role}")
    db.execute(f"CREATE ROLE {role} LOGIN")
    url = make_url(database_url).set(username=role).render_as_string(hide_password=False)
    try:
        # Without USAGE on the schema: that grant, named
        result = cli("status", "--url", url)
        one_line_error(
            result,
            1,
            says=[f"role '{role}' may not use schema dramatiq", f"GRANT USAGE ON SCHEMA dramatiq TO {role}"],
        )
        # With it, but no privilege on the tables: the table, and the owner role to grant
        db.execute(f"GRANT USAGE ON SCHEMA dramatiq TO {role}")
        result = cli("failed", "--url", url)
        one_line_error(
            result,
            1,
            says=[f"role '{role}' may not use table dramatiq.", f"GRANT dramatiq_owner TO {role}"],
        )
        assert "permission denied: permission denied" not in result.stderr
    finally:
        db.execute(f"DROP OWNED BY {role}")
        db.execute(f"DROP ROLE {role}")


# -- the audit trail ----------------------------------------------------------------------------------


def audit_rows(db: Any) -> list[tuple[str, str, str, str, int]]:
    return [
        (str(o), str(s), str(a), str(t), int(c))
        for o, s, a, t, c in db.execute(
            "SELECT operator, source, action, target, count FROM dramatiq.audit ORDER BY id"
        )
    ]


def test_every_action_of_the_command_line_is_audited_with_the_os_user(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import getpass

    db.execute("TRUNCATE dramatiq.audit")
    user = getpass.getuser()
    add_due(db, "aq", 3)
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload, next_attempt_at) "
        "VALUES ('aq', 'charge', gen_random_uuid()::text, '', now() + interval '1 hour')"
    )
    (first, _), _, _, (later, _) = live(db, "aq")
    add_dead_letter(db, "adl")
    add_dead_letter(db, "adl")
    db.execute(
        "INSERT INTO dramatiq.schedules (name, actor_name, queue_name, every_ms, next_run_at) "
        "VALUES ('audited', 'ping', 'default', 60000, now())"
    )
    # When an operator runs each action (and dry runs, which change nothing and record nothing)
    for args in (
        ["pause", "aq"],
        ["resume", "aq"],
        ["cancel", str(first)],
        ["run-now", str(later)],
        ["purge", "aq", "--dry-run"],
        ["purge", "aq"],
        ["retry-failed", "--queue", "adl", "--dry-run"],
        ["discard", "--queue", "adl", "--actor", "charge"],
        ["schedules", "disable", "audited"],
    ):
        run(capsys, *args, "--url", database_url)
    # Then each one is a row: who (the OS user), from where, what, on what, how many rows
    assert audit_rows(db) == [
        (user, "cli", "pause", "aq", 1),
        (user, "cli", "resume", "aq", 1),
        (user, "cli", "cancel", str(first), 1),
        (user, "cli", "run-now", str(later), 1),
        (user, "cli", "purge", "aq", 3),
        (user, "cli", "discard", "queue=adl actor=charge", 2),
        (user, "cli", "schedule-disable", "audited", 1),
    ]
    # And `audit` lists them, newest first, as a table or JSON
    lines = run(capsys, "audit", "--url", database_url).splitlines()
    assert re.match(r"^at\s+operator\s+from\s+action\s+target\s+rows$", lines[0])
    assert "schedule-disable" in lines[1] and "pause" in lines[-1]
    listed = json.loads(run(capsys, "audit", "--json", "--limit", "2", "--url", database_url))["audit"]
    assert [e["action"] for e in listed] == ["schedule-disable", "discard"]
    assert listed[0]["operator"] == user and listed[0]["at"].endswith("+00:00")


#: A sitecustomize that makes one import slow: it touches $DPO_IMPORTING, then sleeps in the
#: import of $DPO_SLOW_IMPORT, so that a test can press Ctrl-C while the command still imports.
SLOW_IMPORT = """
import importlib.abc, os, pathlib, sys, time

class SlowImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == os.environ["DPO_SLOW_IMPORT"]:
            pathlib.Path(os.environ["DPO_IMPORTING"]).touch()
            time.sleep(60)
        return None

sys.meta_path.insert(0, SlowImport())
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    "slow",
    [
        # the package itself: psycopg is among its first imports
        "psycopg",
        # the command line's own modules, after the package
        "dramatiq_pg_outbox.cli.commands",
    ],
)
def test_ctrl_c_while_the_command_still_imports_is_one_line_and_exit_130(tmp_path: Any, slow: str) -> None:
    # Given the command started, and held in the import of `slow`
    (tmp_path / "sitecustomize.py").write_text(SLOW_IMPORT)
    importing = tmp_path / "importing"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "DPO_SLOW_IMPORT": slow,
        "DPO_IMPORTING": str(importing),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "dramatiq_pg_outbox.cli", "status"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As in a terminal: a suite started in the background of a non-interactive shell
        # (`.ci/run &`) ignores SIGINT, its children inherit that, and Python then installs
        # no handler (the command would never see the Ctrl-C).
        preexec_fn=_default_sigint,
    )
    try:
        for _ in range(600):
            if importing.exists() or process.poll() is not None:
                break
            time.sleep(0.05)
        assert importing.exists(), process.communicate(timeout=10)
        # When Ctrl-C is pressed there
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # Then one line, no traceback, and the exit code of an interruption
    assert process.returncode == 130, err
    assert err.splitlines() == ["dramatiq-pg-outbox: error: interrupted"]
    assert out == ""


GOOD_DIGEST = "0" * 64


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        ([f"alice:admin:token:sha256:{GOOD_DIGEST}"], ":3: unknown role 'admin'"),
        (
            [f"alice:operator:token:sha256:{GOOD_DIGEST}", f"alice:read-only:basic:sha256:{'1' * 64}"],
            ":4: user 'alice' is named twice",
        ),
        (["alice:operator:token:hunter2"], ":3: the secret must be sha256:"),
        (["alice:operator"], ":3: expected NAME:ROLE:KIND:sha256:HEX"),
        (["# nobody"], "names no user"),
    ],
)
def test_a_bad_users_file_is_a_usage_error_naming_the_file_and_line(
    tmp_path: Any, database_url: str, lines: list[str], says: str
) -> None:
    path = tmp_path / "users"
    path.write_text("# name:role:kind:sha256:hex\n\n" + "\n".join(lines) + "\n")
    result = cli("dashboard", "--port", "0", "--users-file", str(path), "--url", database_url)
    line = one_line_error(result, EXIT_USAGE, says=[str(path), says])
    assert "hunter2" not in line


def test_a_missing_users_file_from_the_environment_is_a_usage_error(tmp_path: Any, database_url: str) -> None:
    missing = str(tmp_path / "nowhere")
    result = cli(
        "dashboard", "--port", "0", "--url", database_url,
        env={"DRAMATIQ_PG_OUTBOX_DASHBOARD_USERS_FILE": missing},
    )  # fmt: skip
    one_line_error(result, EXIT_USAGE, says=[f"cannot read the users file {missing}", "No such file"])
