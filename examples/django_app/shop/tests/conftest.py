"""Fixtures of the shop's tests: direct connections to each database, the ledger's broker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_pg_outbox import PostgresBroker

from .helpers import url_of


@pytest.fixture
def sql() -> Iterator[Callable[..., list[tuple[Any, ...]]]]:
    """``sql(alias, query, params)``: rows of a query run outside Django, on its own autocommit connection."""
    conns: dict[str, psycopg.Connection[Any]] = {}

    def run(alias: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        if alias not in conns:
            conns[alias] = psycopg.connect(url_of(alias), autocommit=True)
        cursor = conns[alias].execute(query, params)
        return cursor.fetchall() if cursor.description else []

    yield run
    for conn in conns.values():
        conn.close()


@pytest.fixture(autouse=True)
def empty_queues() -> None:
    """Every test starts with no message in either database (Django's flush leaves our tables alone)."""
    for alias in ("default", "ledger"):
        with psycopg.connect(url_of(alias), autocommit=True) as conn:
            conn.execute("DELETE FROM dramatiq.messages; DELETE FROM dramatiq.history")


@pytest.fixture
def ledger_broker() -> Iterator[PostgresBroker]:
    """A second broker, on the "ledger" database; the global one (django_dramatiq's) stays set."""
    broker = PostgresBroker(url=url_of("ledger"), max_fetch_interval=200)
    yield broker
    broker.close()


@pytest.fixture
def make_broker() -> Iterator[Callable[..., PostgresBroker]]:
    """Brokers on the "default" database with other options, closed at the end."""
    brokers: list[PostgresBroker] = []

    def make(**options: Any) -> PostgresBroker:
        broker = PostgresBroker(url=url_of("default"), **options)
        brokers.append(broker)
        return broker

    yield make
    for broker in brokers:
        broker.close()


@pytest.fixture
def global_broker() -> dramatiq.Broker:
    """The broker django_dramatiq built from DRAMATIQ_BROKER."""
    return dramatiq.get_broker()
