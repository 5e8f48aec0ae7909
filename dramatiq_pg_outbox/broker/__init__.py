"""PostgresBroker: Dramatiq on a PostgreSQL table (``broker``), and its consumer (``consumer``)."""

from __future__ import annotations

from ..store.messages import LOOK_AHEAD
from .broker import FOLLOW_UP_SIGNALS, PostgresBroker, broker_for_backend
from .consumer import (
    SUSPECT_AT_DELIVERY,
    ConsumerHost,
    PostgresConsumer,
    PostgresMessage,
    deciding,
)

__all__ = [
    "FOLLOW_UP_SIGNALS",
    "LOOK_AHEAD",
    "SUSPECT_AT_DELIVERY",
    "ConsumerHost",
    "PostgresBroker",
    "PostgresConsumer",
    "PostgresMessage",
    "broker_for_backend",
    "deciding",
]
