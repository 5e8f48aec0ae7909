"""Where ``send()`` looks for an :func:`~dramatiq_pg_outbox.outbox` binding.

The broker asks :func:`current_binding` whether a send joins an application
transaction; :mod:`dramatiq_pg_outbox.outbox` pushes and pops the bindings.
Kept below both so that the broker never imports the outbox module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from .errors import OutboxError

if TYPE_CHECKING:
    from ._runtime import StoredMessage


class Binding(Protocol):
    """What the broker needs of a binding (:class:`~dramatiq_pg_outbox.outbox.Outbox` is one)."""

    #: The broker whose messages join it, or None for every broker.
    broker: Any
    #: The bound Session or Connection, for messages.
    bind: Any
    #: Whether its ``with`` block has ended.
    ended: bool

    def add(self, broker: Any, items: list[StoredMessage]) -> None:
        """Buffer encoded messages in the bound transaction."""

    def joinable(self) -> bool:
        """Whether a message sent now can join the bound transaction.

        False once that transaction has ended in the database (committed or rolled
        back) while its end is still being reported: a send from a listener of its
        commit or rollback.  Such a send goes through the broker's pool.
        """


#: The bindings active in this context (thread or asyncio task), innermost last.
active_bindings: ContextVar[tuple[Binding, ...]] = ContextVar("dramatiq_pg_outbox_bindings", default=())


def current_binding(broker: Any) -> Binding | None:
    """The innermost binding in this context that applies to ``broker``, if any.

    None also when that binding's transaction can no longer take the message
    (``joinable()`` is false: a send from a listener of its commit or rollback):
    the broker then writes it through its pool, as outside ``outbox()``.

    Raises:
      OutboxError: If that binding's block has ended: this context was copied
        from inside the block (``asyncio.create_task``, ``asyncio.to_thread``,
        ``contextvars.copy_context().run``) and outlived it.  Its transaction
        may be committed and closed; buffering the message there would drop it
        without a word.
    """
    for binding in reversed(active_bindings.get()):
        if binding.broker is None or binding.broker is broker:
            if binding.ended:
                raise OutboxError(
                    f"send() through an outbox() binding whose block has ended ({binding.bind!r}): "
                    "this code runs in a task, thread or context started inside `with outbox(...)`, "
                    "which copied the binding. Send inside the block so the message joins that "
                    "transaction, or wrap the send in `with outside_outbox():` to send it on its own."
                )
            return binding if binding.joinable() else None
    return None


@contextmanager
def outside_outbox() -> Iterator[None]:
    """Send outside every :func:`outbox` binding for the duration of a ``with`` block.

    For code that runs in a task, thread or context copied from inside an
    ``outbox()`` block and must send on purpose through the broker's own
    pool (committed at once, whatever happens to that block's transaction).
    Works in ``async`` code too (it does no I/O).
    """
    token = active_bindings.set(())
    try:
        yield
    finally:
        active_bindings.reset(token)
