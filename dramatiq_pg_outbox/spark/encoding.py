"""What a DataFrame row becomes: its message id, idempotency key and encoded payload (JVM or Python)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dramatiq.encoder import Encoder
    from pyspark.sql import DataFrame


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
      skipped(int): Rows whose key was already enqueued (this batch earlier, a retried task).
      partitions(int): Partitions written.
      seconds(float): Wall time of the Spark job.
    """

    batch_id: str
    rows: int
    enqueued: int
    skipped: int
    partitions: int
    seconds: float

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
class _Plan:
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

    @classmethod
    def build(
        cls,
        *,
        key: str,
        args: Sequence[str] = (),
        kwargs: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> _Plan:
        columns = tuple(dict.fromkeys([key, *args, *(kwargs or {}).values()]))
        where = {column: i for i, column in enumerate(columns)}
        return cls(
            columns=columns,
            key=where[key],
            args=tuple(where[c] for c in args),
            kwargs=tuple((name, where[c]) for name, c in (kwargs or {}).items()),
            **fields,
        )


_JVM_JSON_TYPES = ("string", "boolean", "tinyint", "smallint", "int", "bigint", "float", "double")
#: Key types whose Spark string cast equals Python's ``str()``.
_JVM_KEY_TYPES = ("string", "tinyint", "smallint", "int", "bigint")


def _prepare_in_jvm(selected: DataFrame, plan: _Plan, now_ms: int) -> DataFrame | None:
    """(message_id, idempotency_key, payload) computed by Spark itself, or None if it cannot.

    The common case (Dramatiq's default JSON encoder, string or integer key,
    arguments of string, boolean, integer or floating point columns) needs no
    Python per row: Spark builds the JSON payload and the uuid5 id, and the
    executor's Python streams Arrow batches into COPY as CSV.  Anything else
    (another encoder, decimals, dates, nested types) takes the Python path,
    which refuses what the encoder cannot encode.
    """
    import json

    from dramatiq.encoder import JSONEncoder
    from pyspark.sql import functions as F

    types = dict(selected.dtypes)
    columns = plan.columns
    if type(plan.encoder) is not JSONEncoder or types[columns[plan.key]] not in _JVM_KEY_TYPES:
        return None
    values = [*plan.args, *(i for _, i in plan.kwargs)]
    if any(types[columns[i]] not in _JVM_JSON_TYPES for i in values):
        return None

    def col(index: int) -> Any:
        return selected[columns[index]]

    def json_value(column: Any, kind: str = "string") -> Any:
        if kind in ("tinyint", "smallint", "int", "bigint", "float", "double"):
            # Numbers as Spark prints them (1.0E10, NaN, Infinity): json.loads reads them all.
            return F.coalesce(column.cast("string"), F.lit("null"))
        if kind == "boolean":
            return F.when(column, F.lit("true")).when(~column, F.lit("false")).otherwise(F.lit("null"))
        # Strings: to_json escapes them; it takes a struct: {"v":<value>} -> <value>.
        text = F.to_json(F.struct(column.alias("v")), {"ignoreNullFields": "false"})
        return text.substr(F.lit(6), F.length(text) - 6)

    def value(index: int) -> Any:
        return json_value(col(index), types[columns[index]])

    ikey = F.concat(F.lit(f"{plan.batch_id}:"), col(plan.key).cast("string"))
    digest = F.sha1(F.concat(F.unhex(F.lit(NAMESPACE.hex)), F.encode(ikey, "UTF-8")))
    variant = F.element_at(
        F.array(*(F.lit(c) for c in "89ab")),
        (F.conv(F.substring(digest, 17, 1), 16, 10).cast("int").bitwiseAND(3) + 1),
    )
    message_id = F.concat(
        F.substring(digest, 1, 8), F.lit("-"), F.substring(digest, 9, 4), F.lit("-5"),
        F.substring(digest, 14, 3), F.lit("-"), variant, F.substring(digest, 18, 3), F.lit("-"),
        F.substring(digest, 21, 12),
    )  # fmt: skip
    args_json = F.concat(
        F.lit("["),
        F.concat_ws(",", *(value(i) for i in plan.args)) if plan.args else F.lit(""),
        F.lit("]"),
    )
    kwargs_json = F.concat(
        F.lit("{"),
        F.concat_ws(
            ",",
            *(F.concat(F.lit(json.dumps(name) + ":"), value(i)) for name, i in plan.kwargs),
        )
        if plan.kwargs
        else F.lit(""),
        F.lit("}"),
    )
    dumps = _json_dumps()
    options = dumps(plan.options)[:-1] + ("," if plan.options else "") + '"idempotency_key":'
    payload = F.concat(
        F.lit(f'{{"queue_name":{dumps(plan.queue_name)},"actor_name":{dumps(plan.actor_name)},"args":'),
        args_json,
        F.lit(',"kwargs":'),
        kwargs_json,
        F.lit(f',"options":{options}'),
        json_value(ikey),
        F.lit('},"message_id":"'),
        message_id,
        F.lit(f'","message_timestamp":{int(now_ms)}}}'),
    )
    return selected.select(
        message_id.alias("message_id"), ikey.alias("idempotency_key"), payload.alias("payload")
    )


def _arrow_rows(batches: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
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


def _encode_rows(plan: _Plan, rows: Iterable[Any], now_ms: int) -> Iterator[tuple[str, str, bytes]]:
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
        head = f'{{"queue_name":{dumps(plan.queue_name)},"actor_name":{dumps(plan.actor_name)},"args":'
        options = dumps(plan.options)[:-1] + ("," if plan.options else "") + '"idempotency_key":'
    for row in rows:
        key = row[key_at]
        if key is None:
            raise EnqueueError(
                f"Column {plan.columns[key_at]!r} (the key) is null in a row of batch {plan.batch_id!r}; "
                "every row needs a key"
            )
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
        yield message_id, ikey, payload


def _explain(plan: _Plan, row: Any, key: Any, error: Exception) -> str:
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
