"""Each option and each default is written once, in ``dramatiq_pg_outbox/options.py``.

The documentation's options table, the broker's signature, the CLI's defaults
and the readers that judge workers by their heartbeat all follow
:class:`~dramatiq_pg_outbox.options.BrokerOptions`; these tests fail when one
drifts.  ``python -m tests.test_options_doc`` (from the repository's root)
rewrites the table in :data:`DOC`.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.cli import main
from dramatiq_pg_outbox.metrics import DatabaseCollector
from dramatiq_pg_outbox.options import (
    HEARTBEAT_INTERVAL_MS,
    HEARTBEAT_TIMEOUT_MS,
    OPTION_NAMES,
    TABLE_BEGIN,
    TABLE_END,
    BrokerOptions,
    options_table,
    with_options_table,
)

ROOT = Path(__file__).resolve().parents[1]
#: The document that holds the options table between TABLE_BEGIN and TABLE_END.
DOC = ROOT / "docs" / "guides" / "configuration.md"
#: What rewrites it.
REGENERATE = "python -m tests.test_options_doc"

#: Nothing listens there: constructing a broker must not connect.
NOWHERE = "postgresql://nobody@127.0.0.1:1/none"


def test_the_documented_options_table_is_the_one_generated_from_the_options() -> None:
    text = DOC.read_text(encoding="utf-8")
    where = DOC.relative_to(ROOT)
    assert text.count(TABLE_BEGIN) == 1 and text.count(TABLE_END) == 1, (
        f"{where} must hold the lines {TABLE_BEGIN} and {TABLE_END} once each"
    )
    documented = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n").splitlines()
    generated = options_table().strip("\n").splitlines()
    drift = [
        line for line in difflib.unified_diff(documented, generated, str(where), "options.py", lineterm="")
    ]
    assert not drift, (
        f"The options table of {where} differs from dramatiq_pg_outbox/options.py; regenerate it "
        f"(from {ROOT}) with: {REGENERATE}\n" + "\n".join(drift)
    )
    assert with_options_table(text) == text


def test_the_table_has_one_row_per_option_with_its_default_and_unit() -> None:
    rows = [line for line in options_table().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == ["schema", *OPTION_NAMES]
    assert "| `heartbeat_timeout` | 20000 ms |" in options_table()
    assert '| `notify` | `"transaction"` |' in options_table()


def test_the_broker_takes_every_option_with_the_default_of_its_field() -> None:
    # The signature is written out so that type checkers see it: it must list the fields, in order.
    parameters = inspect.signature(PostgresBroker.__init__).parameters
    tuning = {
        name: p
        for name, p in parameters.items()
        if name not in ("self", "url", "engine", "schema", "middleware")
    }
    assert list(tuning) == [f.name for f in fields(BrokerOptions)]
    for f in fields(BrokerOptions):
        assert tuning[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert tuning[f.name].default == f.default, f.name
        assert tuning[f.name].annotation == f.type, f.name


def test_every_option_is_passed_on_and_readable_as_an_attribute_of_the_broker() -> None:
    # Given a value other than the default for every option
    others = {
        "pool_size": 7, "pool_timeout": 3_000, "max_deliveries": 9, "overfetch_factor": 2.5,
        "min_fetch_interval": 11, "max_fetch_interval": 2_000, "flush_interval": 13,
        "max_flush_delay": 29, "flush_batch_size": 17, "heartbeat_interval": 1_000,
        "heartbeat_timeout": 4_000,
        "rescue_interval": 19, "rotate_interval": 23, "max_lease": 60_000, "notify": "off",
        "listen": False, "check_schema": False, "prepare_threshold": None, "max_message_bytes": 5_000,
    }  # fmt: skip
    assert set(others) == set(OPTION_NAMES)
    assert all(others[f.name] != f.default for f in fields(BrokerOptions))
    # When a broker is built with them
    broker = PostgresBroker(url=NOWHERE, **others)
    # Then each reaches its options and reads back as an attribute
    assert broker.options == BrokerOptions(**others)
    assert {name: getattr(broker, name) for name in OPTION_NAMES} == others


def test_every_option_is_documented_in_the_docstrings_of_the_broker_and_of_the_options() -> None:
    for doc in (PostgresBroker.__doc__ or "", BrokerOptions.__doc__ or ""):
        for f in fields(BrokerOptions):
            assert f"\n      {f.name}(" in doc, f.name


# -- the readers and commands that judge workers by the broker's settings --


@pytest.mark.parametrize(
    ("command", "flag", "default"),
    [
        ("metrics", "--heartbeat-timeout", HEARTBEAT_TIMEOUT_MS),
        ("relay", "--heartbeat-timeout", HEARTBEAT_TIMEOUT_MS),
        ("relay", "--heartbeat-interval", HEARTBEAT_INTERVAL_MS),
    ],
)
def test_the_cli_defaults_of_the_heartbeat_are_the_brokers(
    capsys: pytest.CaptureFixture[str], command: str, flag: str, default: int
) -> None:
    # When the command's help is asked for
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    # Then the flag's default, as argparse has it, is the broker's
    text = " ".join(capsys.readouterr().out.split())
    described = text.rsplit(f"{flag} MS ", 1)[1].split(" --", 1)[0]
    assert f"(default: {default}, the broker's)" in described, described


def test_the_readers_judge_workers_by_the_brokers_default_unless_told_otherwise() -> None:
    assert BrokerOptions().heartbeat_timeout == HEARTBEAT_TIMEOUT_MS
    collector = inspect.signature(DatabaseCollector).parameters["heartbeat_timeout"]
    assert collector.default == HEARTBEAT_TIMEOUT_MS
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    from dramatiq_pg_outbox.dashboard.app import Settings
    from dramatiq_pg_outbox.dashboard.store import Store

    assert Settings(url=NOWHERE).heartbeat_timeout == HEARTBEAT_TIMEOUT_MS
    assert inspect.signature(Store).parameters["heartbeat_timeout"].default == HEARTBEAT_TIMEOUT_MS


if __name__ == "__main__":
    DOC.write_text(with_options_table(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"{DOC.relative_to(ROOT)}: options table written")
