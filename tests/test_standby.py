"""A throwaway primary and its streaming standby (``ThrowawayPostgres.start_standby``).

PostgreSQL's own streaming replication between two throwaway servers of this machine
(``pg_basebackup -R``): what the primary commits reaches the standby, which refuses writes
until it is promoted; ``kill_all`` kills every process of a server, as a dying machine.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from dramatiq_pg_outbox.testing import ThrowawayPostgres
from dramatiq_pg_outbox.testing.throwaway import _alive, _processes_of


@pytest.fixture
def primary() -> Iterator[ThrowawayPostgres]:
    try:
        server = ThrowawayPostgres()
    except RuntimeError as e:
        pytest.skip(f"no PostgreSQL binaries for a throwaway server: {e}")
    with server:
        yield server


def _rows(url: str, table: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute(f"SELECT v FROM {table} ORDER BY v")]


def test_a_synchronous_standby_sees_the_primary_s_rows_refuses_writes_and_takes_over(
    primary: ThrowawayPostgres,
) -> None:
    table = f"t_{uuid.uuid4().hex[:8]}"
    with primary.start_standby(synchronous=True, synchronous_commit="remote_apply", slot="s1") as standby:
        assert standby.primary is primary and standby.application_name
        # Given a row committed on the primary (remote_apply: visible on the standby at commit)
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (v text)")
            conn.execute(f"INSERT INTO {table} VALUES ('before')")
        # Then the standby shows it without waiting, and refuses a write
        assert _rows(standby.url, table) == ["before"]
        with psycopg.connect(standby.url, autocommit=True) as conn:
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                conn.execute(f"INSERT INTO {table} VALUES ('on the standby')")
        # When every process of the primary is killed (postmaster, backends, WAL sender)
        postmaster = primary._postmaster_pid()
        assert postmaster is not None
        children = _processes_of(postmaster)
        killed = primary.kill_all()
        assert killed[0] == postmaster and children <= set(killed)
        assert not any(_alive(pid) for pid in killed) and not primary.running
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(primary.url, connect_timeout=2)
        # Then the promoted standby holds the row and accepts writes
        standby.promote()
        assert standby.primary is None
        with psycopg.connect(standby.url, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {table} VALUES ('after')")
        assert _rows(standby.url, table) == ["after", "before"]


def test_an_asynchronous_standby_replays_up_to_a_position_and_lags_while_paused(
    primary: ThrowawayPostgres,
) -> None:
    table = f"t_{uuid.uuid4().hex[:8]}"
    with primary.start_standby() as standby:
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (v text)")
            conn.execute(f"INSERT INTO {table} VALUES ('one')")
        standby.wait_replayed()
        assert _rows(standby.url, table) == ["one"]
        # Given replay paused on the standby
        standby.pause_replay()
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {table} VALUES ('two')")
        lsn = primary.current_lsn()
        # Then the standby does not get there, and shows the data as it stood
        with pytest.raises(TimeoutError, match="replay is paused"):
            standby.wait_replayed(lsn, timeout=0.5)
        assert _rows(standby.url, table) == ["one"]
        # Until replay resumes
        standby.resume_replay()
        standby.wait_replayed(lsn)
        assert _rows(standby.url, table) == ["one", "two"]


def test_kill_all_then_start_recovers_the_server(primary: ThrowawayPostgres) -> None:
    table = f"t_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (v text)")
        conn.execute(f"INSERT INTO {table} VALUES ('kept')")
        # A backend of its own, to be killed with the rest
        assert primary.kill_all()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    assert primary.kill_all() == []  # nothing left to kill
    primary.start()  # crash recovery from the data directory as the kill left it
    assert _rows(primary.url, table) == ["kept"]
