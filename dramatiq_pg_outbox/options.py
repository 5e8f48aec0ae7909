"""The options of a :class:`~dramatiq_pg_outbox.PostgresBroker`: each written once, here.

:class:`BrokerOptions` is the one source of the broker's tuning options.  Each
field carries its name, type, default (a named constant below, with its unit),
the rule its values must follow and one line of documentation; everything else
is derived from the fields:

- the validation: building a :class:`BrokerOptions` checks every option (types,
  ranges, then the rules between options) and raises a ``ValueError`` that
  names the option, the value and the rule;
- the broker's read-only attributes (``broker.pool_size``), the options it
  passes on, and the "Other Parameters" of its docstring;
- the documentation's options table: :func:`options_table`, kept in the
  documents between :data:`TABLE_BEGIN` and :data:`TABLE_END` by
  :func:`with_options_table` (``python -m tests.test_options_doc`` rewrites it;
  that test fails when they drift);
- the defaults of the command line (``--heartbeat-timeout`` of ``metrics`` and
  ``relay``) and of the readers that judge workers by their heartbeat (the
  dashboard, the metrics exporter).

An option added later is one more field here (and one more keyword argument
of ``PostgresBroker.__init__``, which a test keeps equal to the fields).  Oban
and River give each plugin the same shape: an options struct, then validate,
then start.

Names (schemas, queues, channels) are in :mod:`dramatiq_pg_outbox.names`.
"""

from __future__ import annotations

import math
import numbers
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from .names import DEFAULT_SCHEMA

NotifyMode = Literal["transaction", "after_commit", "off"]
#: The accepted values of ``notify``.
NOTIFY_MODES: tuple[NotifyMode, ...] = ("transaction", "after_commit", "off")

#: ``heartbeat_timeout`` must be at least this many heartbeat intervals: a
#: live worker whose heartbeat is one period late (a slow statement, a pause)
#: must not count as dead, or its messages would be released and run twice.
MIN_HEARTBEATS_PER_TIMEOUT = 2

# -- the defaults, each with its unit ----------------------------------------------

POOL_SIZE = 4
POOL_TIMEOUT_MS = 10_000
MAX_DELIVERIES = 5
OVERFETCH_FACTOR = 16.0
MIN_FETCH_INTERVAL_MS = 0
MAX_FETCH_INTERVAL_MS = 1_000
FLUSH_INTERVAL_MS = 5
#: The longest flush window when ``max_flush_delay`` is not given (or ``flush_interval``, if longer).
MAX_FLUSH_DELAY_MS = 20
FLUSH_BATCH_SIZE = 1_000
#: A worker thread that decides while this many x ``flush_batch_size`` decisions are unwritten
#: waits for the flusher: one batch being written, one gathering (docs/guarantees.md).
UNWRITTEN_BATCHES = 2
HEARTBEAT_INTERVAL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 20_000
RESCUE_INTERVAL_MS = 5_000
ROTATE_INTERVAL_MS = 10_000
MAX_LEASE_MS: int | None = None
NOTIFY: NotifyMode = "transaction"
LISTEN = True
CHECK_SCHEMA = True
PREPARE_THRESHOLD: int | None = 0
#: 1 MiB, as many brokers (Amazon SQS allows 256 KiB, RabbitMQ's default frame limit is larger).
MAX_MESSAGE_BYTES: int | None = 1_048_576

# -- the rules ------------------------------------------------------------------------


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


def _notify(name: str, value: Any) -> NotifyMode:
    if value not in NOTIFY_MODES:
        raise _invalid(name, value, "it must be 'transaction', 'after_commit' or 'off'")
    mode: NotifyMode = value
    return mode


def _positive_finite(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _invalid(name, value, "it must be a finite number > 0")
    return float(value)


def _prepare_threshold(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _invalid(
            name,
            value,
            "it must be None (never prepare a statement: behind PgBouncer's transaction pooling) "
            "or an integer >= 0",
        )
    return int(value)


@dataclass(frozen=True)
class Rule:
    """The values an option accepts.

    Attributes:
      text(str): The rule as the documentation states it (Markdown), e.g. ``integer >= 1``.
      check(Callable[[str, Any], Any]): ``check(name, value)`` returns the value to keep
        (an ``int`` for an integral value of another type, a ``float`` for a real) or
        raises ``ValueError("<name>=<value!r> is invalid: <rule>")``.
      unit(str): ``"ms"`` for a time in milliseconds, else ``""``.
    """

    text: str
    check: Callable[[str, Any], Any]
    unit: str = ""


def integer(minimum: int) -> Rule:
    """An ``int`` (not a ``bool`` or ``float``) >= ``minimum``."""
    return Rule(f"integer >= {minimum}", lambda name, value: _integer(name, value, minimum))


def milliseconds(minimum: int, text: str | None = None) -> Rule:
    """A time: an integer number of milliseconds >= ``minimum`` (``text``: the rule as documented)."""
    return Rule(
        text or f"integer >= {minimum}", lambda name, value: _milliseconds(name, value, minimum), "ms"
    )


def optional(rule: Rule) -> Rule:
    """``None`` (off), or a value of ``rule``."""
    return Rule(
        f"`None`, or {rule.text}",
        lambda name, value: None if value is None else rule.check(name, value),
        rule.unit,
    )


FLAG = Rule("`True` or `False`", _flag)


@dataclass(frozen=True)
class OptionSpec:
    """What a field of :class:`BrokerOptions` carries besides its name, type and default.

    Attributes:
      doc(str): What the option does, as one Markdown phrase (lower case, no final period;
        links relative to the documentation's ``docs/guides/``, shown as their text in docstrings).
      rule(Rule): The values it accepts.
    """

    doc: str
    rule: Rule


#: The key of a :class:`BrokerOptions` field's :class:`OptionSpec` in its ``metadata``.
SPEC = "dramatiq_pg_outbox.option"

T = TypeVar("T")


def _option(default: T, rule: Rule, doc: str) -> T:
    value: T = field(default=default, metadata={SPEC: OptionSpec(doc, rule)})
    return value


# -- the options ------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerOptions:
    """Validated tuning options of a :class:`~dramatiq_pg_outbox.PostgresBroker`.

    Each is also a keyword argument of the broker and a read-only attribute of
    it (``broker.pool_size``).  Times are integer milliseconds, as everywhere in
    Dramatiq; integers are ``int``, never ``bool`` or ``float``.  The
    parameters, their defaults and rules are listed below (generated from the
    fields); :func:`options_table` renders them for the documentation.

    Raises:
      ValueError: At construction, for the first option (in the order of the
        fields) that breaks its rule, then for ``max_flush_delay`` below
        ``flush_interval``, then for ``heartbeat_timeout`` below
        ``2 x heartbeat_interval``; the message names the option, the value and
        the rule.
    """

    pool_size: int = _option(POOL_SIZE, integer(1), "most pooled connections per process")
    pool_timeout: int = _option(POOL_TIMEOUT_MS, milliseconds(1), "longest wait for a pooled connection")
    max_deliveries: int = _option(
        MAX_DELIVERIES,
        integer(1),
        "claims of one stored message before it is quarantined (moved to history as `failed`, "
        "with `MaxDeliveriesExceeded`, and never run again)",
    )
    overfetch_factor: float = _option(
        OVERFETCH_FACTOR,
        Rule("finite number > 0", _positive_finite),
        "a consumer holds at most `prefetch x overfetch_factor` claimed, unacknowledged messages "
        "(Dramatiq's prefetch is 2 x threads); within that cap it adapts: its buffer starts at "
        "4 x prefetch, doubles after a claim of a backlog during which its threads ran dry "
        "(short tasks: big batched claims) and halves, down to the prefetch, when most of what it "
        "held was still waiting (long tasks do not hoard messages another process could start); "
        "1.0 pins it to the prefetch",
    )
    min_fetch_interval: int = _option(
        MIN_FETCH_INTERVAL_MS, milliseconds(0), "pause after a fetch that filled the buffer"
    )
    max_fetch_interval: int = _option(
        MAX_FETCH_INTERVAL_MS,
        milliseconds(1),
        "poll interval of an idle consumer (a NOTIFY, or the due time of its next delayed "
        "message, wakes it earlier; 0 would poll in a busy loop)",
    )
    flush_interval: int = _option(
        FLUSH_INTERVAL_MS,
        milliseconds(0),
        "shortest flush window: decisions (acks, nacks, with their follow-ups) are gathered this "
        "long after the first, then written together; the window of an idle process",
    )
    max_flush_delay: int | None = _option(
        None,
        optional(milliseconds(0, "integer >= `flush_interval`")),
        "longest flush window: while a backlog drains (each flush writes many decisions) the window "
        "doubles from `flush_interval` up to this, and it halves when flushes are small and "
        "returns to `flush_interval` when the process idles; a decided message waits at most this "
        "long (plus a statement) before it is written; `flush_interval` pins the window; `None`: "
        f"{MAX_FLUSH_DELAY_MS} ms, or `flush_interval` if longer",
    )
    flush_batch_size: int = _option(
        FLUSH_BATCH_SIZE,
        integer(1),
        "decided but unwritten messages of a process that end the flush window at once; a worker "
        f"thread that decides while {UNWRITTEN_BATCHES} x `flush_batch_size` are unwritten waits "
        "for the flush, which bounds what runs again after a crash "
        "([Guarantees](../guarantees.md#what-runs-again-after-a-crash))",
    )
    heartbeat_interval: int = _option(HEARTBEAT_INTERVAL_MS, milliseconds(1), "worker heartbeat period")
    heartbeat_timeout: int = _option(
        HEARTBEAT_TIMEOUT_MS,
        milliseconds(1, f"integer >= {MIN_HEARTBEATS_PER_TIMEOUT} x `heartbeat_interval`"),
        "silence after which a worker counts as dead and its messages are released; at least "
        f"{MIN_HEARTBEATS_PER_TIMEOUT} x `heartbeat_interval`, so that one late heartbeat never "
        "makes a live worker look dead",
    )
    rescue_interval: int = _option(
        RESCUE_INTERVAL_MS,
        milliseconds(0),
        "period of the release-stuck pass (jittered +-20 %); 0: a pass at every heartbeat",
    )
    rotate_interval: int = _option(
        ROTATE_INTERVAL_MS,
        milliseconds(0),
        "age at which the ring of partitions that holds the messages turns to an empty "
        "partition; the process's reclaim loop checks about five times per interval, moves the "
        "few rows left in older partitions and empties them with TRUNCATE, which needs no vacuum "
        "([Storage and retention](storage.md#storage-under-a-long-transaction)); 0: this process "
        "leaves the ring to the others",
    )
    max_lease: int | None = _option(
        MAX_LEASE_MS,
        optional(milliseconds(1)),
        "optional hard bound on one delivery: a message claimed longer ago is released even if "
        "its worker is alive; off by default, so that long tasks are safe",
    )
    # _option returns a dataclasses.field (ruff sees only a call, and a type it cannot tell immutable).
    notify: NotifyMode = _option(  # noqa: RUF009
        NOTIFY,
        Rule("`" + "`, `".join(NOTIFY_MODES[:-1]) + f"` or `{NOTIFY_MODES[-1]}`", _notify),
        "`transaction`: NOTIFY in the enqueueing transaction (delivered at commit); "
        "`after_commit`: from the broker's own connection after the application commits "
        "(avoids the commit-time NOTIFY lock when many writers notify); `off`: no NOTIFY",
    )
    listen: bool = _option(
        LISTEN,
        FLAG,
        "whether consumers LISTEN for wake-ups; polling alone still delivers everything. "
        "Behind a pooler that shares server connections (PgBouncer in transaction pooling) "
        "the listener finds it at start, warns once and polls; `False` skips that probe "
        "([Behind PgBouncer](pgbouncer.md))",
    )
    check_schema: bool = _option(CHECK_SCHEMA, FLAG, "check the schema revision on first use")
    prepare_threshold: int | None = _option(
        PREPARE_THRESHOLD,
        Rule("`None`, or integer >= 0", _prepare_threshold),
        "executions of one statement on one pooled connection after which psycopg prepares it "
        "on the server (psycopg's `prepare_threshold`; its default is 5, ours 0: a pooled "
        "connection plans each statement once, and the claims before the first message waits on "
        "them); `None` never prepares: "
        "pass it behind PgBouncer in transaction pooling without `max_prepared_statements` "
        "(before 1.21), where the next transaction may run on a server connection on which the "
        "statement's name is missing or is another client's ([Behind PgBouncer](pgbouncer.md)); "
        "not a URL parameter",
    )
    max_message_bytes: int | None = _option(
        MAX_MESSAGE_BYTES,
        optional(integer(1)),
        "largest encoded message, in bytes: a larger one is refused by `send()` with "
        "`MessageTooLarge` (inside `outbox()` before the commit, nothing of it written), a larger "
        "follow-up (a pipeline's next step, a result) quarantines the message whose hooks sent it "
        "(moved to history as `failed` with `FollowUpNotWritable`, never retried), and the Spark "
        "writer refuses a larger row; `None`: no limit",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            spec: OptionSpec = f.metadata[SPEC]
            # Integral values of another type (numpy ints) are stored as plain ints.
            object.__setattr__(self, f.name, spec.rule.check(f.name, getattr(self, f.name)))
        if self.max_flush_delay is None:
            object.__setattr__(self, "max_flush_delay", max(MAX_FLUSH_DELAY_MS, self.flush_interval))
        elif self.max_flush_delay < self.flush_interval:
            raise _invalid(
                "max_flush_delay",
                self.max_flush_delay,
                f"it must be at least flush_interval ({self.flush_interval} ms), the shortest window; "
                "pass max_flush_delay=flush_interval for a fixed window",
            )
        least = MIN_HEARTBEATS_PER_TIMEOUT * self.heartbeat_interval
        if self.heartbeat_timeout < least:
            raise _invalid(
                "heartbeat_timeout",
                self.heartbeat_timeout,
                f"it must be at least {MIN_HEARTBEATS_PER_TIMEOUT} x heartbeat_interval "
                f"({MIN_HEARTBEATS_PER_TIMEOUT} x {self.heartbeat_interval} = {least} ms), "
                "or a live worker whose heartbeat is late would look dead and its messages would run twice",
            )


#: The names of the options, in the order of the fields.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(BrokerOptions))


def check_positive_ints(**values: int | None) -> None:
    """Refuse any value that is not an integer >= 1 (``None`` passes: "off").

    Raises:
      ValueError: Naming the first option that breaks the rule.
    """
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, not {value!r}")


# -- the documentation, generated from the fields ----------------------------------------

#: The line before the generated options table in a Markdown document.
TABLE_BEGIN = "<!-- options-table:begin -->"
#: The line after it.
TABLE_END = "<!-- options-table:end -->"

#: The ``schema`` argument, a row of the table though not a tuning option (checked by
#: :func:`~dramatiq_pg_outbox.names.validate_schema_name`, not here).
_SCHEMA_ROW = (
    "schema",
    f"`{DEFAULT_SCHEMA}`",
    "letters, digits and `_`, not starting with a digit, at most 63 characters",
    "schema of the tables; NOTIFY channel `dramatiq_pg_outbox.<schema>`, or for names over 44 "
    "characters `dramatiq_pg_outbox.<first 27>.<16 hex of SHA-256>` (PostgreSQL's 63-byte limit)",
)


def _default_text(value: Any, unit: str) -> str:
    """A default as the documentation shows it: ``10000 ms``, ``16.0``, `` `None` ``, `` `"off"` ``."""
    if isinstance(value, bool) or value is None:
        return f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"{value} {unit}".strip()


def _rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for f in fields(BrokerOptions):
        spec: OptionSpec = f.metadata[SPEC]
        rows.append((f.name, _default_text(f.default, spec.rule.unit), spec.rule.text, spec.doc))
    return rows


def options_table() -> str:
    """The Markdown table of the broker's options (``schema`` first, then every field of
    :class:`BrokerOptions` in order): option, default with its unit, accepted values, meaning.

    Returns:
      str: The table, one line per row, ending with a newline.
    """
    lines = ["| option | default | accepted values | meaning |", "|---|---|---|---|"]
    name, default, rule, doc = _SCHEMA_ROW
    lines.append(f"| `{name}` | {default} | {rule} | {doc} |")
    for name, default, rule, doc in _rows():
        lines.append(f"| `{name}` | {default} | {rule} | {doc} |")
    return "\n".join(lines) + "\n"


def with_options_table(text: str) -> str:
    """``text`` (a Markdown document) with its lines between :data:`TABLE_BEGIN` and
    :data:`TABLE_END` replaced by :func:`options_table`.

    Raises:
      ValueError: If the document does not hold each marker exactly once, in that order.
    """
    if text.count(TABLE_BEGIN) != 1 or text.count(TABLE_END) != 1:
        raise ValueError(f"expected one {TABLE_BEGIN!r} line and one {TABLE_END!r} line")
    head, rest = text.split(TABLE_BEGIN)
    if TABLE_END not in rest:
        raise ValueError(f"{TABLE_END!r} comes before {TABLE_BEGIN!r}")
    _, tail = rest.split(TABLE_END)
    # Blank lines around the table: to Python-Markdown (MkDocs) an HTML comment runs on to the
    # next blank line, and would swallow a table that followed it at once.
    return f"{head}{TABLE_BEGIN}\n\n{options_table()}\n{TABLE_END}{tail}"


def _rst(markdown: str) -> str:
    """Markdown inline code (`` `x` ``) as reStructuredText's (````x````) and links
    (``[text](page.md)``) as their text, for docstrings."""
    return re.sub(r"`([^`]+)`", r"``\1``", re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", markdown))


def options_docstring(indent: str = "      ") -> str:
    """The options as a Google-style parameter list, for the docstrings of the broker and of
    :class:`BrokerOptions`: ``name(type): Meaning.  Rule.  Default X.``, wrapped at 96 columns.

    Parameters:
      indent(str): The indentation of each entry (continuation lines get two more spaces).

    Returns:
      str: One entry per option, each ending with a newline.
    """
    entries = []
    for name, default, rule, doc in _rows():
        kind = str(BrokerOptions.__dataclass_fields__[name].type).replace("NotifyMode", "str")
        accepted = f"Milliseconds, {rule}" if default.endswith(" ms") else rule[0].upper() + rule[1:]
        text = f"{name}({kind}): {doc[0].upper()}{doc[1:]}.  {accepted}.  Default {default}."
        # A rule's ">= 1" stays on one line (NUL is no space to textwrap).
        wrapped = textwrap.fill(
            _rst(text).replace(">= ", ">=\0"), 96, initial_indent=indent, subsequent_indent=indent + "  "
        )
        entries.append(wrapped.replace("\0", " ") + "\n")
    return "".join(entries)


BrokerOptions.__doc__ = f"{(BrokerOptions.__doc__ or '').rstrip()}\n\n    Parameters:\n{options_docstring()}"
