"""The command line for scripts: --json, dry runs, limits, and one-line errors of the new subcommands."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.migrations import SCHEMA_REVISION
from tests.helpers import count, drop_past_history_partitions
from tests.test_cli import cli, closed_port, dead_letter, old_schema, one_line_error

__all__ = ["closed_port", "old_schema"]  # fixtures, imported for pytest


def failed_count(db: Any) -> int:
    return count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'")


def test_status_and_failed_print_json_for_scripts(
    database_url: str, broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    # Given a dead letter, a waiting message and a paused queue
    row_id, _ = dead_letter(broker, start_worker, db)
    db.execute("TRUNCATE dramatiq.queue_pauses")
    try:
        assert cli("pause", "reports", "--create", "--url", database_url).returncode == 0
        # When status and failed are asked for JSON
        status = json.loads(cli("status", "--json", "--url", database_url).stdout)
        failed = json.loads(cli("failed", "--json", "--url", database_url).stdout)
    finally:
        db.execute("TRUNCATE dramatiq.queue_pauses")
    # Then they parse, with the same facts as the tables
    assert status["schema"] == "dramatiq"
    assert status["dead_letters"] == [{"queue": "default", "failed_last_hour": 1, "failed_in_history": 1}]
    assert [p["queue"] for p in status["paused"]] == ["reports"]
    assert status["workers"] and "default" in status["workers"][0]["queues"]
    assert [(f["id"], f["queue"], f["error_type"]) for f in failed] == [(row_id, "default", "RuntimeError")]
    assert failed[0]["finished_at"].endswith("+00:00") and "boom" in failed[0]["error"]


def test_retry_failed_dry_run_limit_and_actor(
    database_url: str, broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    # Given three dead letters of one actor
    first, worker = dead_letter(broker, start_worker, db)
    worker.stop()  # (a re-enqueued message stays waiting)
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, "
        "started_at, finished_at, error_type, error, payload) "
        "SELECT id + 1000000 + n, queue_name, actor_name, message_id || n, state, attempts, enqueued_at, "
        "started_at, "
        "finished_at + n * interval '1 second', error_type, error, payload "
        "FROM dramatiq.history, generate_series(1, 2) AS n WHERE id = %s",
        (first,),
    )
    messages = count(db, "SELECT count(*) FROM dramatiq.messages")
    # When a dry run is asked for at most two
    result = cli("retry-failed", "--dry-run", "--limit", "2", "--url", database_url)
    # Then it says what would move and moves nothing
    assert result.returncode == 0, result
    assert result.stdout.splitlines() == [
        "would re-enqueue 2 failed message(s) (default: 2)",
        "dry run: nothing changed",
    ]
    assert failed_count(db) == 3 and count(db, "SELECT count(*) FROM dramatiq.messages") == messages
    # When another actor is named, nothing matches
    assert (
        "re-enqueued 0 failed message(s)"
        in cli("retry-failed", "--actor", "other", "--url", database_url).stdout
    )
    # When it runs for real with the limit: the oldest one goes first
    result = cli("retry-failed", "--actor", "boom", "--limit", "1", "--url", database_url)
    assert result.stdout.strip() == "re-enqueued 1 failed message(s)"
    assert failed_count(db) == 2
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE id = %s", (first,)) == 0


def test_prune_dry_run_counts_what_prune_then_removes(
    database_url: str, broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    drop_past_history_partitions(db)  # another test's old partitions would be counted
    dead_letter(broker, start_worker, db)
    db.execute("UPDATE dramatiq.history SET finished_at = now() - interval '2 days'")
    dry = cli("prune", "--older-than", "36h", "--dry-run", "--url", database_url)
    assert dry.returncode == 0, dry
    assert dry.stdout.strip() == (
        "would drop 0 day partition(s) of about 0 row(s), would delete 1 history row(s) older than 1 d 12 h, "
        "would free 0 idempotency key(s) (dry run: nothing changed)"
    )
    assert count(db, "SELECT count(*) FROM dramatiq.history") == 1
    real = cli("prune", "--older-than", "36h", "--url", database_url)
    assert (
        real.stdout.strip()
        == "dropped 0 day partition(s) of about 0 row(s), deleted 1 history row(s) older than 1 d 12 h, "
        "freed 0 idempotency key(s)"
    )
    assert count(db, "SELECT count(*) FROM dramatiq.history") == 0


@pytest.mark.parametrize(
    "command", [["failed", "--queue"], ["retry-failed", "--queue"], ["pause"], ["resume"]]
)
def test_a_bad_queue_name_is_a_usage_error(database_url: str, command: list[str]) -> None:
    result = cli(*command, "no way!", "--url", database_url)
    one_line_error(result, 2, says=["no way!"])


@pytest.mark.parametrize("command", [["pause", "emails"], ["resume", "emails"]])
def test_pause_and_resume_report_errors_in_one_line(
    closed_port: int, database_url: str, old_schema: str, command: list[str]
) -> None:
    unreachable = cli(*command, "--url", f"postgresql://app:s3cret@127.0.0.1:{closed_port}/app")
    one_line_error(unreachable, 1, says=["cannot connect"], hides="s3cret")
    old = cli(*command, "--url", database_url, "--schema", old_schema)
    one_line_error(
        old, 1, says=["is at revision 2", f"needs {SCHEMA_REVISION}", "dramatiq-pg-outbox migrate"]
    )
