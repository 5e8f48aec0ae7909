"""PostgresBroker: Dramatiq on a PostgreSQL table (``broker``), and its consumer (``consumer``)."""

from __future__ import annotations

from .broker import FOLLOW_UP_SIGNALS, PostgresBroker, broker_for_backend
from .consumer import (
    LOOK_AHEAD,
    SUSPECT_AT_DELIVERY,
    ConsumerHost,
    _PostgresConsumer,
    _PostgresMessage,
    deciding,
)

__all__ = [
    "FOLLOW_UP_SIGNALS",
    "LOOK_AHEAD",
    "SUSPECT_AT_DELIVERY",
    "ConsumerHost",
    "PostgresBroker",
    "_PostgresConsumer",
    "_PostgresMessage",
    "broker_for_backend",
    "deciding",
]
