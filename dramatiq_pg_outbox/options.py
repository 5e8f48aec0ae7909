"""The options of a :class:`~dramatiq_pg_outbox.PostgresBroker`, validated in one place.

:class:`BrokerOptions` holds every tuning option; building one checks them
all (types, ranges, and the rules between options) and raises a
``ValueError`` that names the option, the value and the rule.  The broker
builds one in its constructor and copies the values to its attributes.
Oban and River give each plugin the same shape: an options struct, then
validate, then start.

Names (schemas, queues, channels) are in :mod:`dramatiq_pg_outbox.names`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

NotifyMode = Literal["transaction", "after_commit", "off"]
#: The accepted values of ``notify``.
NOTIFY_MODES: tuple[NotifyMode, ...] = ("transaction", "after_commit", "off")

#: ``heartbeat_timeout`` must be at least this many heartbeat intervals: a
#: live worker whose heartbeat is one period late (a slow statement, a pause)
#: must not count as dead, or its messages would be released and run twice.
MIN_HEARTBEATS_PER_TIMEOUT = 2


def _invalid(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {rule}")


def _integer(name: str, value: Any, minimum: int, unit: str = "") -> int:
    """``value`` as an int if it is an integer (not a bool, not a float) >= ``minimum``."""
    what = f"an integer{unit} >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _invalid(name, value, f"it must be {what}")
    if value < minimum:
        raise _invalid(name, value, f"it must be {what}")
    return int(value)


def _milliseconds(name: str, value: Any, minimum: int) -> int:
    return _integer(name, value, minimum, " number of milliseconds")


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _invalid(name, value, "it must be True or False")
    return value


def check_positive_ints(**values: int | None) -> None:
    """Refuse any value that is not an integer >= 1 (``None`` passes: "off").

    Raises:
      ValueError: Naming the first option that breaks the rule.
    """
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, not {value!r}")


@dataclass(frozen=True)
class BrokerOptions:
    """Validated tuning options of a :class:`~dramatiq_pg_outbox.PostgresBroker`.

    The meaning and default of each is documented on the broker.  Rules
    (times are integer milliseconds, as everywhere in Dramatiq; integers are
    ``int``, never ``bool`` or ``float``):

    ====================  ========================================================
    pool_size             integer >= 1
    pool_timeout          integer ms >= 1
    max_deliveries        integer >= 1
    overfetch_factor      finite real number > 0 (int or float, not bool)
    min_fetch_interval    integer ms >= 0
    max_fetch_interval    integer ms >= 1 (0 would poll in a busy loop)
    flush_interval        integer ms >= 0
    flush_batch_size      integer >= 1
    heartbeat_interval    integer ms >= 1
    heartbeat_timeout     integer ms >= 2 x heartbeat_interval
    rescue_interval       integer ms >= 0 (0: a rescue pass at every heartbeat)
    rotate_interval       integer ms >= 0 (0: this process leaves the ring alone)
    max_lease             None, or integer ms >= 1
    notify                "transaction", "after_commit" or "off"
    listen, check_schema  True or False
    prepare_threshold     None (never prepare), or integer >= 0
    ====================  ========================================================

    Raises:
      ValueError: At construction, for the first option that breaks its rule,
        naming the option, the value and the rule.
    """

    pool_size: int = 4
    pool_timeout: int = 10_000
    max_deliveries: int = 5
    overfetch_factor: float = 16.0
    min_fetch_interval: int = 0
    max_fetch_interval: int = 1_000
    flush_interval: int = 5
    flush_batch_size: int = 1_000
    heartbeat_interval: int = 5_000
    heartbeat_timeout: int = 20_000
    rescue_interval: int = 5_000
    rotate_interval: int = 10_000
    max_lease: int | None = None
    notify: NotifyMode = "transaction"
    listen: bool = True
    check_schema: bool = True
    prepare_threshold: int | None = 5

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {
            "pool_size": _integer("pool_size", self.pool_size, 1),
            "pool_timeout": _milliseconds("pool_timeout", self.pool_timeout, 1),
            "max_deliveries": _integer("max_deliveries", self.max_deliveries, 1),
            "overfetch_factor": self._overfetch_factor(),
            "min_fetch_interval": _milliseconds("min_fetch_interval", self.min_fetch_interval, 0),
            "max_fetch_interval": _milliseconds("max_fetch_interval", self.max_fetch_interval, 1),
            "flush_interval": _milliseconds("flush_interval", self.flush_interval, 0),
            "flush_batch_size": _integer("flush_batch_size", self.flush_batch_size, 1),
            "heartbeat_interval": _milliseconds("heartbeat_interval", self.heartbeat_interval, 1),
            "heartbeat_timeout": _milliseconds("heartbeat_timeout", self.heartbeat_timeout, 1),
            "rescue_interval": _milliseconds("rescue_interval", self.rescue_interval, 0),
            "rotate_interval": _milliseconds("rotate_interval", self.rotate_interval, 0),
            "max_lease": None if self.max_lease is None else _milliseconds("max_lease", self.max_lease, 1),
            "listen": _flag("listen", self.listen),
            "check_schema": _flag("check_schema", self.check_schema),
            "prepare_threshold": self._prepare_threshold(),
        }
        if self.notify not in NOTIFY_MODES:
            raise _invalid("notify", self.notify, "it must be 'transaction', 'after_commit' or 'off'")
        least = MIN_HEARTBEATS_PER_TIMEOUT * checked["heartbeat_interval"]
        if checked["heartbeat_timeout"] < least:
            raise _invalid(
                "heartbeat_timeout",
                self.heartbeat_timeout,
                f"it must be at least {MIN_HEARTBEATS_PER_TIMEOUT} x heartbeat_interval "
                f"({MIN_HEARTBEATS_PER_TIMEOUT} x {checked['heartbeat_interval']} = {least} ms), "
                "or a live worker whose heartbeat is late would look dead and its messages would run twice",
            )
        # Integral values of another type (numpy ints) are stored as plain ints.
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def _prepare_threshold(self) -> int | None:
        value = self.prepare_threshold
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise _invalid(
                "prepare_threshold",
                value,
                "it must be None (never prepare a statement: behind PgBouncer's transaction pooling) "
                "or an integer >= 0",
            )
        return int(value)

    def _overfetch_factor(self) -> float:
        value = self.overfetch_factor
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise _invalid("overfetch_factor", value, "it must be a finite number > 0")
        return float(value)
