"""What a DataFrame row becomes: its message id, idempotency key and payload (a batch or a row at a time)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dramatiq.encoder import Encoder


#: Namespace of the uuid5 message ids of :func:`enqueue_dataframe`.
NAMESPACE = uuid.UUID("5b0d1c1e-7f4e-5a43-9d0e-0a6f0c0b7d21")


class EnqueueError(ValueError):
    """A row could not become a message (null key, unencodable argument)."""


@dataclass(frozen=True)
class EnqueueResult:
    """What :func:`enqueue_dataframe` did.

    Attributes:
      batch_id(str): The batch id.
      rows(int): Rows read from the DataFrame.
      enqueued(int): New messages.
      skipped(int): Rows whose key was already enqueued (this batch earlier, a retried task,
        or another partition of this write that holds the same key).
      repeated(int): Rows whose key another row of the same partition has (the first of them
        is enqueued); ``on_duplicate_key="error"`` fails the job instead.
      partitions(int): Partitions written.
      seconds(float): Wall time of the Spark job.
    """

    batch_id: str
    rows: int
    enqueued: int
    skipped: int
    partitions: int
    seconds: float
    repeated: int = 0

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("inf")


def idempotency_key_for(batch_id: str, key: Any) -> str:
    """The idempotency key of the row with ``key`` in batch ``batch_id`` (``str(key)`` is used)."""
    return f"{batch_id}:{key}"


def message_id_for(batch_id: str, key: Any) -> str:
    """The deterministic message id of the row with ``key`` in batch ``batch_id``."""
    return str(uuid.uuid5(NAMESPACE, idempotency_key_for(batch_id, key)))


@dataclass(frozen=True)
class Plan:
    """Everything an executor needs, pickled once per task (no Spark objects).

    Rows reach the executor as tuples in the order of ``columns``; ``key``,
    ``args`` and ``kwargs`` hold positions in them.
    """

    #: Holds the password: kept out of the repr (Spark may print a failed task's closure).
    conninfo: str = field(repr=False)
    schema: str
    channel: str
    queue_name: str
    actor_name: str
    batch_id: str
    columns: tuple[str, ...]
    key: int
    args: tuple[int, ...]
    kwargs: tuple[tuple[str, int], ...]
    options: dict[str, Any]
    delay_ms: int
    notify: bool
    encoder: Encoder
    #: The ``broker_priority`` option, validated (0: none).
    priority: int = 0
    #: Largest encoded message, in bytes (the broker's ``max_message_bytes``); None: no limit.
    max_bytes: int | None = None
    #: How a decimal argument is written with the JSON encoder: ``string`` (exact) or ``float``.
    decimals: str = "string"
    #: A key the data holds twice: ``skip`` (count it, enqueue the first row) or ``error``.
    on_duplicate_key: str = "skip"

    @classmethod
    def build(
        cls,
        *,
        key: str,
        args: Sequence[str] = (),
        kwargs: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> Plan:
        columns = tuple(dict.fromkeys([key, *args, *(kwargs or {}).values()]))
        where = {column: i for i, column in enumerate(columns)}
        return cls(
            columns=columns,
            key=where[key],
            args=tuple(where[c] for c in args),
            kwargs=tuple((name, where[c]) for name, c in (kwargs or {}).items()),
            **fields,
        )


#: The values of ``Plan.decimals``.
DECIMALS = ("string", "float")
#: The values of ``Plan.on_duplicate_key``.
ON_DUPLICATE_KEY = ("skip", "error")


def portable_batch(plan: Plan, batch: Any) -> Any:
    """``batch`` with its timestamp, date and decimal arguments as JSON can carry them.

    Dramatiq's ``JSONEncoder`` refuses these types; with it (and only with it: another
    encoder gets the values as they are) each argument column of such a type becomes:

    - ``TimestampType`` (an Arrow timestamp with a time zone): ISO 8601 in UTC with its
      offset, ``2026-11-27T10:00:00+00:00`` (``.123456`` before the offset when the
      microseconds are not 0), as ``datetime.isoformat()`` writes it;
    - ``TimestampNTZType`` (no time zone): ISO 8601 without an offset, ``2026-11-27T10:00:00``;
    - ``DateType``: ``2026-11-27``;
    - ``DecimalType``: its exact text (``str(Decimal)``, ``12.50``), or a float with
      ``plan.decimals == "float"``.

    Nulls stay null.  The key column is left alone: its text is part of the idempotency
    key (``str(key)``), which must not change.  Both encoders (:func:`encode_batch`,
    :func:`encode_rows`) then see strings or floats, so their bytes stay identical.

    Parameters:
      plan(Plan): The write plan (its encoder, key position and ``decimals``).
      batch(pyarrow.RecordBatch): Rows in ``plan.columns`` order.
    """
    import datetime as dt

    import pyarrow as pa
    from dramatiq.encoder import JSONEncoder

    if type(plan.encoder) is not JSONEncoder:
        return batch
    columns, changed = list(batch.columns), False
    for i, column in enumerate(columns):
        kind = column.type
        if i == plan.key:
            continue
        if pa.types.is_timestamp(kind):
            if kind.tz is None:
                text = [None if v is None else v.isoformat() for v in column.to_pylist()]
            else:
                text = [
                    None if v is None else v.astimezone(dt.timezone.utc).isoformat()
                    for v in column.to_pylist()
                ]
            columns[i] = pa.array(text, pa.string())
        elif pa.types.is_date(kind):
            columns[i] = pa.array(
                [None if v is None else v.isoformat() for v in column.to_pylist()], pa.string()
            )
        elif pa.types.is_decimal(kind):
            values = column.to_pylist()
            if plan.decimals == "float":
                columns[i] = pa.array([None if v is None else float(v) for v in values], pa.float64())
            else:
                columns[i] = pa.array([None if v is None else str(v) for v in values], pa.string())
        else:
            continue
        changed = True
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names) if changed else batch


#: What JSON escapes (as ``json.dumps`` with ``ensure_ascii`` writes it): anything but
#: printable ASCII, the quote and the backslash.  RE2 syntax, for ``pyarrow.compute``.
_NEEDS_ESCAPE = r"[^\x20\x21\x23-\x5b\x5d-\x7e]"


def batch_encodable(plan: Plan, schema: Any) -> bool:
    """Whether :func:`encode_batch` encodes rows of this Arrow schema (else: row by row).

    It does with Dramatiq's own JSON encoder, a string or integer key and arguments of
    string, boolean, integer or floating point columns (the common case).
    """
    import pyarrow as pa
    from dramatiq.encoder import JSONEncoder

    if type(plan.encoder) is not JSONEncoder:
        return False
    types = [schema.field(name).type for name in plan.columns]
    key_type = types[plan.key]
    if not (
        pa.types.is_integer(key_type) or pa.types.is_string(key_type) or pa.types.is_large_string(key_type)
    ):
        return False
    kinds = (pa.types.is_integer, pa.types.is_boolean, pa.types.is_floating, pa.types.is_string,
             pa.types.is_large_string)  # fmt: skip
    return all(any(kind(types[i]) for kind in kinds) for i in (*plan.args, *(i for _, i in plan.kwargs)))


def _json_frame(plan: Plan, dumps: Callable[[Any], str]) -> tuple[str, str]:
    """The constant parts of a payload, as Dramatiq's JSONEncoder writes the message dict.

    Returns:
      tuple[str, str]: What comes before the args (``{"queue_name":...,"args":``) and the
      options object up to the idempotency key's value (``{...,"idempotency_key":``).
    """
    head = f'{{"queue_name":{dumps(plan.queue_name)},"actor_name":{dumps(plan.actor_name)},"args":'
    options = dumps(plan.options)[:-1] + ("," if plan.options else "") + '"idempotency_key":'
    return head, options


def _null_key(plan: Plan) -> EnqueueError:
    """The error of a row without a key (its column and the batch are named)."""
    return EnqueueError(
        f"Column {plan.columns[plan.key]!r} (the key) is null in a row of batch {plan.batch_id!r}; "
        "every row needs a key"
    )


def _json_column(column: Any, dumps: Callable[[Any], str]) -> Any:
    """Each value of an Arrow column as JSON text, byte for byte as ``json.dumps`` writes it.

    Integers and booleans by Arrow casts, strings quoted by Arrow where nothing needs an
    escape (``json.dumps`` only for the values that do), floats by ``json.dumps`` (Arrow
    prints ``1.0`` as ``1``, which would decode as an integer); nulls as ``null``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_integer(kind):
        text = pc.cast(column, pa.string())
    elif pa.types.is_boolean(kind):
        text = pc.if_else(column, pa.scalar("true"), pa.scalar("false"))
    elif pa.types.is_floating(kind):
        text = pa.array([dumps(value) for value in column.to_pylist()], pa.string())
    else:
        column = pc.cast(column, pa.string())
        text = pc.binary_join_element_wise(pa.scalar('"'), column, pa.scalar('"'), pa.scalar(""))
        escape = pc.fill_null(pc.match_substring_regex(column, _NEEDS_ESCAPE), False)
        if pc.any(escape).as_py():
            escaped = [dumps(value) for value in pc.filter(column, escape).to_pylist()]
            text = pc.replace_with_mask(text, escape, pa.array(escaped, pa.string()))
    return pc.fill_null(text, pa.scalar("null"))


def encode_batch(plan: Plan, batch: Any, now_ms: int) -> Any:
    """An Arrow batch of rows (``plan.columns``) as a batch of (message_id, idempotency_key, payload).

    Column at a time with ``pyarrow.compute`` where :func:`batch_encodable` says so; the
    payloads are byte for byte those of :func:`encode_rows` (Dramatiq's JSON encoder), the
    message ids its uuid5 ids (one SHA-1 per row in Python: Arrow has no SHA-1).

    Raises:
      EnqueueError: A null key, naming the key column and the batch.
    """
    import hashlib

    import pyarrow as pa
    import pyarrow.compute as pc

    dumps = _json_dumps()
    ikey = batch_keys(plan, batch)
    prefix = hashlib.sha1(NAMESPACE.bytes, usedforsecurity=False)
    message_id = pa.array([_uuid5(prefix, k) for k in ikey.to_pylist()], pa.string())
    head, options = _json_frame(plan, dumps)
    pieces: list[Any] = [head + "["]
    for n, i in enumerate(plan.args):
        pieces += [","] if n else []
        pieces.append(_json_column(batch.column(i), dumps))
    pieces.append('],"kwargs":{')
    for n, (name, i) in enumerate(plan.kwargs):
        pieces.append(("," if n else "") + dumps(name) + ":")
        pieces.append(_json_column(batch.column(i), dumps))
    pieces += [f'}},"options":{options}', _json_column(ikey, dumps), '},"message_id":"', message_id,
               f'","message_timestamp":{int(now_ms)}}}']  # fmt: skip
    payload = pc.binary_join_element_wise(
        *(pa.scalar(piece) if isinstance(piece, str) else piece for piece in pieces), pa.scalar("")
    )
    if plan.max_bytes is not None and len(payload):
        over = pc.greater(pc.binary_length(payload), plan.max_bytes)
        if pc.any(over).as_py():
            first = pc.index(over, True).as_py()
            size = len(payload[first].as_py())
            raise EnqueueError(_too_large(plan, batch.column(plan.key)[first].as_py(), size))
    return pa.RecordBatch.from_arrays(
        [message_id, ikey, payload], ["message_id", "idempotency_key", "payload"]
    )


def batch_keys(plan: Plan, batch: Any) -> Any:
    """The idempotency keys of an Arrow batch of rows (``plan.columns``), an Arrow string array.

    Raises:
      EnqueueError: A null key, naming the key column and the batch.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    key = batch.column(plan.key)
    if key.null_count:
        raise _null_key(plan)
    return pc.binary_join_element_wise(
        pa.scalar(f"{plan.batch_id}:"), pc.cast(key, pa.string()), pa.scalar("")
    )


#: What opens a binary ``COPY`` (its signature, flags 0, no header extension) and what ends it.
COPY_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
COPY_BINARY_TRAILER = b"\xff\xff"


def copy_binary_rows(fields: Sequence[Any]) -> bytes:
    """Rows in ``COPY ... (FORMAT BINARY)``'s format, without its header and trailer.

    Each field is either a constant, the same in every row (``bytes``: the value's binary
    form, such as the UTF-8 of a text or the big-endian bytes of a smallint), or an Arrow
    string or binary array without nulls (a text or a bytea column: its bytes).  Arrow joins
    each row's field count and each field's int32 length and bytes in one
    ``binary_join_element_wise``: no Python per row.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = next((len(f) for f in fields if not isinstance(f, bytes)), None)
    if rows is None:
        raise ValueError("copy_binary_rows needs at least one column")
    pieces: list[Any] = [len(fields).to_bytes(2, "big")]
    for value in fields:
        if isinstance(value, bytes):
            pieces.append(len(value).to_bytes(4, "big") + value)
            continue
        lengths = pc.binary_length(value).to_numpy(zero_copy_only=False).astype(">i4")
        framed = pa.Array.from_buffers(pa.binary(4), rows, [None, pa.py_buffer(lengths.tobytes())])
        pieces += [pc.cast(framed, pa.binary()), pc.cast(value, pa.binary())]
    merged: list[Any] = []  # neighbouring constants as one
    for piece in pieces:
        if isinstance(piece, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += piece
        else:
            merged.append(piece)
    joined = pc.binary_join_element_wise(
        *(pa.scalar(p, pa.binary()) if isinstance(p, bytes) else p for p in merged),
        pa.scalar(b"", pa.binary()),
    )
    offsets = np.frombuffer(joined.buffers()[1], np.int32, count=rows + 1, offset=joined.offset * 4)
    return bytes(joined.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_pybytes())


def arrow_rows(batches: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    for batch in batches:
        yield from zip(*(column.to_pylist() for column in batch.columns), strict=True)


def _uuid5(prefix: Any, name: str) -> str:
    """``str(uuid.uuid5(namespace, name))`` for a sha1 object primed with the namespace, faster."""
    digest = prefix.copy()
    digest.update(name.encode("utf-8"))
    h = digest.hexdigest()
    # Version 5 in the high nibble of byte 6, RFC 4122 variant in the top bits of byte 8.
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}


def _json_dumps() -> Callable[[Any], str]:
    """A compact ``json.dumps`` (as Dramatiq's JSONEncoder writes) that reuses one C encoder."""
    import json
    from json import encoder as json_encoder

    make = getattr(json_encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return json.JSONEncoder(separators=(",", ":")).encode
    iterencode = make(
        None,
        json.JSONEncoder().default,
        json_encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        False,
        False,
        True,
    )

    def dumps(value: Any) -> str:
        return "".join(iterencode(value, 0))

    return dumps


def encode_rows(plan: Plan, rows: Iterable[Any], now_ms: int) -> Iterator[tuple[str, str, bytes]]:
    """(message id, idempotency key, payload) per row; raises EnqueueError naming the bad column."""
    import hashlib

    from dramatiq.encoder import JSONEncoder

    prefix = hashlib.sha1(NAMESPACE.bytes, usedforsecurity=False)
    batch = f"{plan.batch_id}:"
    key_at, args_at, kwargs_at = plan.key, plan.args, plan.kwargs
    fast = type(plan.encoder) is JSONEncoder
    if fast:
        # Byte for byte what JSONEncoder.encode gives for the message dict,
        # with the constant parts rendered once.
        dumps = _json_dumps()
        head, options = _json_frame(plan, dumps)
    for row in rows:
        key = row[key_at]
        if key is None:
            raise _null_key(plan)
        ikey = batch + str(key)
        message_id = _uuid5(prefix, ikey)
        try:
            if fast:
                payload = (
                    f"{head}{dumps([row[i] for i in args_at])}"
                    f',"kwargs":{dumps({name: row[i] for name, i in kwargs_at})}'
                    f',"options":{options}{dumps(ikey)}}}'
                    f',"message_id":"{message_id}","message_timestamp":{now_ms}}}'
                ).encode()
            else:
                payload = plan.encoder.encode(
                    {
                        "queue_name": plan.queue_name,
                        "actor_name": plan.actor_name,
                        "args": [row[i] for i in args_at],
                        "kwargs": {name: row[i] for name, i in kwargs_at},
                        "options": {**plan.options, "idempotency_key": ikey},
                        "message_id": message_id,
                        "message_timestamp": now_ms,
                    }
                )
        except Exception as e:
            raise EnqueueError(_explain(plan, row, key, e)) from e
        if plan.max_bytes is not None and len(payload) > plan.max_bytes:
            raise EnqueueError(_too_large(plan, key, len(payload)))
        yield message_id, ikey, payload


def repeated_key(plan: Plan, key: str, repeated: int) -> EnqueueError:
    """The error of a partition that holds a key twice under ``on_duplicate_key="error"``."""
    return EnqueueError(
        f"Column {plan.columns[plan.key]!r} (the key) repeats: {repeated:,} row(s) of a partition of batch "
        f"{plan.batch_id!r} have the key of an earlier row (first: idempotency key {key!r}); "
        "on_duplicate_key='error' refuses them (nothing of this task's partition was written): "
        "deduplicate the data (df.dropDuplicates([key])) or pass on_duplicate_key='skip'"
    )


def _too_large(plan: Plan, key: Any, size: int) -> str:
    return (
        f"The row with {plan.columns[plan.key]}={key!r} is {size:,} bytes encoded as a message for "
        f"actor {plan.actor_name!r}, over max_message_bytes={plan.max_bytes:,}: write a reference "
        "to the data instead (nothing of this task's partition was written)"
    )


def _explain(plan: Plan, row: Any, key: Any, error: Exception) -> str:
    key_name = plan.columns[plan.key]
    for i in (*plan.args, *(i for _, i in plan.kwargs)):
        try:
            plan.encoder.encode({"value": row[i]})
        except Exception as e:
            value = row[i]
            return (
                f"Column {plan.columns[i]!r} of the row with {key_name}={key!r} cannot be encoded "
                f"({type(value).__name__} {value!r}: {e}); cast it to a supported type"
            )
    return f"The row with {key_name}={key!r} cannot be encoded: {error}"
