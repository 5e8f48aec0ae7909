"""Names: schemas, queues and NOTIFY channels, and the rules they follow.

The bottom of the package: every module that builds a name or an identifier
takes it from here, and this module imports nothing of the package.
"""

from __future__ import annotations

import hashlib
import re

#: Schema of the tables unless told otherwise.
DEFAULT_SCHEMA = "dramatiq"

#: A message due more than this many milliseconds after its enqueue is stored in the
#: ``messages_vacuumed`` partition, not in the ring that TRUNCATE empties (migration 0013):
#: a delayed row in the ring would keep its partition from being emptied until it is due.
PARK_AFTER_MS = 30_000

_IDENTIFIER = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]{0,62}")
#: Dramatiq's queue-name rule.
_QUEUE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")
#: Longest queue name accepted (NOTIFY payloads and index entries stay small), in characters.
MAX_QUEUE_NAME = 200


def validate_schema_name(schema: str) -> str:
    """Check a schema name before it reaches any SQL.

    Parameters:
      schema(str): A PostgreSQL schema name: ``[a-zA-Z_][a-zA-Z0-9_]*``, at most 63 characters.

    Raises:
      ValueError: If the name is not of that form.

    Returns:
      str: The name, unchanged.
    """
    if not isinstance(schema, str) or not _IDENTIFIER.fullmatch(schema):
        raise ValueError(
            f"Invalid schema name {schema!r}: use letters, digits and underscores, "
            "starting with a letter or underscore, at most 63 characters."
        )
    return schema


def quote_ident(name: str) -> str:
    """Return ``name`` as a double-quoted SQL identifier (after :func:`validate_schema_name`)."""
    validate_schema_name(name)
    return '"' + name.replace('"', '""') + '"'


#: Prefix of the NOTIFY channel of every schema.
CHANNEL_PREFIX = "dramatiq_pg_outbox."
#: Longest channel name PostgreSQL accepts, in bytes (``NAMEDATALEN - 1``).
MAX_CHANNEL_BYTES = 63
#: Hex digits of the hash that ends a shortened channel name (64 bits).
CHANNEL_HASH_DIGITS = 16
#: Prefix of the results NOTIFY channel of a schema.
RESULTS_CHANNEL_PREFIX = "dramatiq_pg_outbox_results."
#: Prefix of the rate-limit events NOTIFY channel of a schema.
RATE_LIMITS_CHANNEL_PREFIX = "dramatiq_pg_outbox_limits."


def channel_for(schema: str) -> str:
    """The LISTEN/NOTIFY channel of the broker tables in ``schema``.

    ``dramatiq_pg_outbox.<schema>`` when that fits PostgreSQL's 63-byte limit
    on channel names (schemas of up to 44 characters: unchanged, so brokers
    of older versions and of this one still hear each other).  A longer
    schema name gets ``dramatiq_pg_outbox.<its first 27 characters>.<16 hex
    digits of its SHA-256>``: exactly 63 bytes, different for different
    schemas, and never equal to an unshortened channel (a schema name
    contains no ``.``).  Without this, ``pg_notify`` fails with "channel name
    too long" and every send fails with it.

    Parameters:
      schema(str): A valid schema name (ASCII letters, digits, ``_``).

    Returns:
      str: The channel name, at most 63 bytes.
    """
    channel = CHANNEL_PREFIX + schema
    if len(channel.encode()) <= MAX_CHANNEL_BYTES:
        return channel
    digest = hashlib.sha256(schema.encode()).hexdigest()[:CHANNEL_HASH_DIGITS]
    keep = MAX_CHANNEL_BYTES - len(CHANNEL_PREFIX) - 1 - CHANNEL_HASH_DIGITS
    return f"{CHANNEL_PREFIX}{schema[:keep]}.{digest}"


def results_channel(schema: str) -> str:
    """The NOTIFY channel of the results table in ``schema``.

    ``dramatiq_pg_outbox_results.<schema>``, or, when that exceeds
    PostgreSQL's 63 bytes, the prefix followed by 16 hex digits of the
    schema's SHA-256 (distinct schemas, distinct channels).  It differs
    from the broker's channel, so result notifications never wake consumers.
    """
    channel = RESULTS_CHANNEL_PREFIX + schema
    if len(channel.encode()) <= MAX_CHANNEL_BYTES:
        return channel
    return RESULTS_CHANNEL_PREFIX + hashlib.sha256(schema.encode()).hexdigest()[:CHANNEL_HASH_DIGITS]


def rate_limits_channel(schema: str) -> str:
    """The NOTIFY channel of the rate-limit events in ``schema`` (``wait_notify`` wakes ``wait``).

    ``dramatiq_pg_outbox_limits.<schema>``, shortened like :func:`results_channel`.
    """
    channel = RATE_LIMITS_CHANNEL_PREFIX + schema
    if len(channel.encode()) <= MAX_CHANNEL_BYTES:
        return channel
    return RATE_LIMITS_CHANNEL_PREFIX + hashlib.sha256(schema.encode()).hexdigest()[:CHANNEL_HASH_DIGITS]


def validate_queue_name(queue_name: str) -> str:
    """Check a queue name before it reaches any SQL.

    Raises:
      ValueError: If it does not match ``[a-zA-Z_][a-zA-Z0-9._-]*`` or is too long.
    """
    if (
        not isinstance(queue_name, str)
        or not _QUEUE_NAME.fullmatch(queue_name)
        or len(queue_name) > MAX_QUEUE_NAME
    ):
        raise ValueError(
            f"Invalid queue name {queue_name!r}: Dramatiq queue names match [a-zA-Z_][a-zA-Z0-9._-]* "
            f"(at most {MAX_QUEUE_NAME} characters)."
        )
    return queue_name
