"""A message in its stored form, the enqueue statement's parameters and result, notifications, errors."""

from __future__ import annotations

import dataclasses
import traceback
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import MessageTooLarge
from ..names import PARK_AFTER_MS
from ..store.messages import EnqueueRow, EnqueueStatement, Statement

if TYPE_CHECKING:
    from dramatiq import Message

#: Longest text of a dead-lettered message's error that is stored, in characters.
MAX_ERROR_CHARS = 8_000

#: Highest ``broker_priority`` a message may carry (0 is the default and the lowest).
#: 255 is the largest priority AMQP and RabbitMQ accept (an unsigned octet).
MAX_PRIORITY = 255


def format_error(exc: BaseException | None) -> tuple[str, str]:
    """(type name, traceback text clipped to ``MAX_ERROR_CHARS``) of a failed message's exception.

    A NUL character, which PostgreSQL's ``text`` refuses (the archive would fail
    for good and hold back every later decision), is stored as ``\\x00``.
    """
    if exc is None:
        return "Unknown", "the message failed without an exception (for example, it was skipped)"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return storable_text(type(exc).__name__), clip_error(text)


def storable_text(text: str) -> str:
    """``text`` with each NUL character written ``\\x00``: PostgreSQL's ``text`` cannot hold it."""
    return text.replace("\x00", "\\x00")


def clip_error(text: str) -> str:
    """An error text made storable (see :func:`storable_text`) and clipped to ``MAX_ERROR_CHARS``."""
    text = storable_text(text)
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS // 2] + "\n[...]\n" + text[-MAX_ERROR_CHARS // 2 :]
    return text


@dataclass
class Conditional:
    """Messages that an outcome writes only if ``statement``, run first in its transaction, returns true.

    A group's completion callbacks (``rate_limits``): ``statement`` counts the barrier down
    and says whether it opened, so the count-down and the callbacks commit with the
    member's ack, or neither does.
    """

    statement: Statement
    #: Written with the outcome's other messages when ``statement`` returned true.
    messages: list[StoredMessage] = field(default_factory=list)


@dataclass
class Outcome:
    """The end of one delivery and what its middleware sent or stored meanwhile.

    Written by the flusher in one transaction, fenced by the lease: the ack or
    nack of row ``row_id``, then ``messages`` (a retry, the next pipeline step,
    a callback) and ``statements`` (a result) for that row only if the fence
    held.  Either all of it commits or none does and the message is delivered
    again (see docs/guarantees.md, "Follow-ups belong to the ack").
    """

    row_id: int
    lease: uuid.UUID
    #: ``"ack"``, ``"ack_with_error"`` (the actor raised and Dramatiq acked) or ``"nack"``.
    kind: str
    error_type: str | None = None
    error: str | None = None
    #: Messages enqueued while the outcome was decided, in their stored form.
    messages: list[StoredMessage] = field(default_factory=list)
    #: Other writes of that phase: results of PostgresBackend.
    statements: list[Statement] = field(default_factory=list)
    #: Messages written only if their statement returns true (group completion callbacks).
    conditional: list[Conditional] = field(default_factory=list)
    #: Follow-ups refused when sent (over ``max_message_bytes``), one line each: the
    #: flusher quarantines the message instead of writing any of its follow-ups.
    refused: list[str] = field(default_factory=list)

    def fence(self) -> tuple[int, uuid.UUID, str | None, str | None]:
        """(row id, lease, error type, error), the item form of the plain decision buffers."""
        return self.row_id, self.lease, self.error_type, self.error


@dataclass(frozen=True)
class StoredMessage:
    """A message in the form it is written: encoded and keyed when it is sent.

    Encoding at ``send()`` time means an encoding error is raised by ``send()``
    itself, and arguments mutated after ``send()`` are not what gets stored.
    """

    #: The message (on its canonical queue, without Dramatiq's ``eta``).
    message: Message[Any]
    #: Minimum delay before delivery, in milliseconds.
    delay: int
    #: ``message.encode()``: what the workers will decode.
    payload: bytes
    #: The idempotency key (see :func:`idempotency_key`), or None.
    key: str | None
    #: The claim order among due messages of its queue (see :func:`broker_priority`).
    priority: int = 0
    #: Its concurrency key and the limit it was sent with (see :func:`concurrency`).
    concurrency_key: str | None = None
    concurrency_limit: int | None = None

    @classmethod
    def of(cls, message: Message[Any], delay: int = 0, max_bytes: int | None = None) -> StoredMessage:
        """Encode ``message`` now (``max_bytes``: the broker's ``max_message_bytes``, None: no limit).

        Raises:
          ValueError: If its ``idempotency_key`` option is not a non-empty string,
            its ``broker_priority`` option not an integer from 0 to ``MAX_PRIORITY``, or its
            ``concurrency_key``/``concurrency_limit`` bad (see :func:`concurrency`).
          MessageTooLarge: If it encodes to more than ``max_bytes`` bytes.
          TypeError: If an argument cannot be encoded (see :func:`encode`).
        """
        key = idempotency_key(message)
        priority = broker_priority(message.options)
        concurrency_key, concurrency_limit = concurrency(message.options)
        payload = encode(message)
        if max_bytes is not None and len(payload) > max_bytes:
            raise MessageTooLarge(message.actor_name, len(payload), max_bytes)
        return cls(message, delay, payload, key, priority, concurrency_key, concurrency_limit)


def encode(message: Message[Any]) -> bytes:
    """``message.encode()``, with an error that says which argument could not be encoded.

    Dramatiq's JSON encoder raises a bare ``TypeError`` (``Object of type X is
    not JSON serializable``) that names neither the actor nor the argument.
    On a failure, each argument is encoded alone to find the first culprit.

    Raises:
      TypeError: (or ``ValueError``, as the encoder raised) "cannot send actor
        'A': argument 2 (a Decimal) cannot be encoded: ...", or ``keyword argument
        'k'``, or ``its options``.
    """
    try:
        return message.encode()
    except (TypeError, ValueError) as e:
        raise unencodable(message, e) from e


def unencodable(message: Message[Any], error: TypeError | ValueError) -> TypeError | ValueError:
    """The error of :func:`encode` for ``message``, whose encoding raised ``error``."""

    def fails(**parts: Any) -> bool:
        try:
            dataclasses.replace(message, **{"args": (), "kwargs": {}, "options": {}, **parts}).encode()
        except (TypeError, ValueError):
            return True
        return False

    where = "its arguments together"
    culprits = [
        *((f"argument {i}", value) for i, value in enumerate(message.args) if fails(args=(value,))),
        *(
            (f"keyword argument {name!r}", value)
            for name, value in message.kwargs.items()
            if fails(kwargs={name: value})
        ),
    ]
    if culprits:
        what, value = culprits[0]
        where = f"{what} (a {type(value).__name__})"
    elif fails(options=message.options):
        where = "its options"
    text = f"cannot send actor {message.actor_name!r}: {where} cannot be encoded: {error}"
    return TypeError(text) if isinstance(error, TypeError) else ValueError(text)


def enqueue_statement(
    items: Sequence[StoredMessage], channel: str, notify: bool, notify_within: int, return_ids: bool = False
) -> EnqueueStatement:
    """The statement that stores ``items`` in one statement: (query name, parameters).

    One message without an idempotency key takes ``enqueue_one`` (scalar
    parameters); other batches take ``enqueue``, or the cheaper
    ``enqueue_unkeyed`` when no message has an idempotency key.  ``notify``
    says whether the statement itself calls ``pg_notify``; ``notify_within``
    (ms): delayed messages due within it are announced as ``queue@due``;
    ``return_ids``: the statement also returns the ids of the rows it inserted.
    Run it with ``MessageStore.enqueue``, read its rows with :func:`enqueue_result`.
    """
    limited = any(item.concurrency_key is not None for item in items)
    if len(items) == 1 and items[0].key is None and not limited:
        item = items[0]
        return EnqueueStatement(
            "enqueue_one",
            {
                "queue_name": item.message.queue_name,
                "actor_name": item.message.actor_name,
                "message_id": item.message.message_id,
                "delay": item.delay,
                "payload": item.payload,
                "priority": item.priority,
                "channel": channel,
                "notify": notify,
                "notify_within": notify_within,
                "return_ids": return_ids,
                "park_after_ms": PARK_AFTER_MS,
            },
        )
    keys = [item.key for item in items]
    params = {
        "queue_names": [item.message.queue_name for item in items],
        "actor_names": [item.message.actor_name for item in items],
        "message_ids": [item.message.message_id for item in items],
        "delays": [item.delay for item in items],
        "payloads": [item.payload for item in items],
        "priorities": [item.priority for item in items],
        "channel": channel,
        "notify": notify,
        "notify_within": notify_within,
        "return_ids": return_ids,
        "park_after_ms": PARK_AFTER_MS,
    }
    if limited or any(key is not None for key in keys):
        # The general statement: idempotency keys and concurrency keys (the cheaper two
        # stay as they were for the messages that have neither).
        params["idempotency_keys"] = keys
        params["concurrency_keys"] = [item.concurrency_key for item in items]
        params["concurrency_limits"] = [item.concurrency_limit for item in items]
        return EnqueueStatement("enqueue", params)
    return EnqueueStatement("enqueue_unkeyed", params)


@dataclass
class EnqueueResult:
    """What one enqueue statement did (see :func:`enqueue_result`)."""

    #: The messages actually stored: all but idempotency duplicates.
    stored: list[StoredMessage]
    #: NOTIFY payloads the statement sent, or would have sent with ``notify`` on.
    payloads: list[str]
    #: (row id, message id) of each inserted row, when asked for with ``return_ids``.
    ids: list[tuple[int, str]]


def enqueue_result(name: str, items: Sequence[StoredMessage], rows: Sequence[EnqueueRow]) -> EnqueueResult:
    """Read the rows of the enqueue statement ``name`` (``MessageStore.enqueue``).

    Every message is stored except, for ``enqueue``, those whose idempotency
    key was already taken (the statement returns the keys it inserted; of two
    messages with one key in a batch, the first is stored).
    """
    payloads = [row.payload for row in rows if row.payload is not None]
    ids = [(int(row.id), str(row.message_id)) for row in rows if row.id is not None]
    if name != "enqueue":
        return EnqueueResult(list(items), payloads, ids)
    inserted_keys = {row.key for row in rows if row.key is not None}
    stored = []
    for item in items:
        if item.key is None:
            stored.append(item)
        elif item.key in inserted_keys:
            inserted_keys.discard(item.key)
            stored.append(item)
    return EnqueueResult(stored, payloads, ids)


def idempotency_key(message: Message[Any]) -> str | None:
    """The key that makes ``message`` unique in the queue tables, or None.

    It is the ``idempotency_key`` option (``actor.send_with_options(...,
    idempotency_key="...")``), for a first enqueue only: a retry that the
    Retries middleware enqueues carries the same options (``retries`` >= 1) but
    is the same message again, so it is stored without a key.

    Raises:
      ValueError: If the option is not a non-empty string.
    """
    key = message.options.get("idempotency_key")
    if key is None or message.options.get("retries"):
        return None
    if not isinstance(key, str) or not key:
        raise ValueError(f"idempotency_key must be a non-empty string, not {key!r}")
    return key


def broker_priority(options: Mapping[str, Any]) -> int:
    """The ``broker_priority`` of a message's options: 0 (the default) to :data:`MAX_PRIORITY`.

    As with Dramatiq's ``RabbitmqBroker``, a higher number is delivered first:
    the claim takes the due messages of a queue by priority, highest first,
    then in due order (FIFO within a priority).  Not the actor's ``priority``
    option, by which Dramatiq's worker orders the messages it already holds.

    Raises:
      ValueError: If the option is not an integer from 0 to ``MAX_PRIORITY``.
    """
    priority = options.get("broker_priority")
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"broker_priority must be an integer from 0 to {MAX_PRIORITY}, not {priority!r}")
    return priority


#: Longest concurrency key, in characters.
MAX_CONCURRENCY_KEY = 200


def concurrency(options: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """(``concurrency_key``, ``concurrency_limit``) of a message's options.

    A message with a concurrency key is claimed only while fewer than its key's limit
    of messages with that key are processing, across every worker process
    (docs/guides/concurrency.md).  The limit is the run-time one of the key's
    longest prefix (``dramatiq-pg-outbox limits``), else ``concurrency_limit``
    (the message's option, or its actor's), else 1.

    Returns:
      tuple: The key (None: the message is not limited) and the limit it carries
      (None: the default).

    Raises:
      ValueError: If the key is not a non-empty string of at most
        :data:`MAX_CONCURRENCY_KEY` characters, or the limit not an integer >= 0, or a
        limit is given without a key.
    """
    key, limit = options.get("concurrency_key"), options.get("concurrency_limit")
    if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_CONCURRENCY_KEY):
        raise ValueError(
            f"concurrency_key must be a non-empty string of at most {MAX_CONCURRENCY_KEY} characters, "
            f"not {key!r}"
        )
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"concurrency_limit must be an integer >= 0, not {limit!r}")
        if key is None:
            raise ValueError("concurrency_limit needs a concurrency_key (the messages it limits)")
    return key, limit


def prioritized_notification(payload: str) -> bool:
    """Whether a broker channel notification announces a message with a ``broker_priority``.

    The enqueue statements mark them ``"<queue>!"`` (or ``"<queue>!@<due>"``):
    the queue's consumers then claim with ``claim_prioritized`` at once.
    """
    return "!" in payload


#: The mark of a notification that a message with a concurrency key finished (``"<queue>~"``):
#: a slot of its key is free, and nothing new was stored.
SLOT_FREED = "~"


def slot_freed_notification(payload: str) -> bool:
    """Whether a broker channel notification says that a keyed message of its queue finished."""
    return payload.endswith(SLOT_FREED)


def parse_notification(payload: str) -> tuple[str, int | None]:
    """(queue name, due time or None) of a broker channel notification.

    ``"<queue>"``: a message of that queue is due now.  ``"<queue>@<due>"``:
    a delayed message falls due at ``<due>``, epoch milliseconds on the
    database clock.  Queue names never contain ``@``, ``!`` or ``~``; a ``!`` after
    the name (see :func:`prioritized_notification`) or a ``~``
    (:func:`slot_freed_notification`) is dropped.  A malformed
    due time counts as "now" (an early claim costs a round trip, never a message).
    """
    queue_name, at, due = payload.partition("@")
    queue_name = queue_name.rstrip("!" + SLOT_FREED)
    if not at:
        return queue_name, None
    try:
        return queue_name, int(due)
    except ValueError:
        return queue_name, None


#: The lease fence_params saw last before its first item: no lease is this object.
_NO_LEASE = object()


def fence_params(items: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The parameters of a fenced statement for ``(row id, lease, ...)`` items.

    The text of a lease (``uuid.UUID.__str__``, Python code) is made once per run of
    items that share the lease object, as the messages of one claim do: formatting
    it for every item cost more than the rest of the fence (benchmarks/README.md
    section 30).

    Returns:
      dict: ``ids`` (list[int]) and ``fences`` (list[str], ``"<row id>/<lease>"``
      per item, matched by the ``fenced`` fragment of queries.sql).
    """
    ids: list[int] = []
    fences: list[str] = []
    last: object = _NO_LEASE
    suffix = ""
    for item in items:
        row_id, lease = item[0], item[1]
        if lease is not last:
            last, suffix = lease, f"/{lease}"
        ids.append(row_id)
        fences.append(f"{row_id}{suffix}")
    return {"ids": ids, "fences": fences}
