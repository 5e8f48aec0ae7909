"""Concurrency keys from actor options: the middleware that :class:`PostgresBroker` adds.

An actor declares ``concurrency_key`` (a string, or a function of the message's
arguments that returns one, or None for no key) and ``concurrency_limit`` (an integer
>= 0); each message it sends then carries them in its options, where
``send_with_options(concurrency_key=..., concurrency_limit=...)`` puts them too (the
message's own options win).  The claim enforces them (docs/guides/concurrency.md).

The idea of deriving the key from the arguments is Hatchet's and Oban Pro's
("partition by args"); the option names follow Dramatiq's own (``max_retries``,
``time_limit``): lower case, on the actor or the message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dramatiq import Broker, Message
from dramatiq.errors import ActorNotFound
from dramatiq.middleware import Middleware


class ConcurrencyKeys(Middleware):
    """Declares the actor options ``concurrency_key`` and ``concurrency_limit`` (Dramatiq refuses
    an actor option that no middleware declares); :class:`PostgresBroker` adds it.

    Actor options:
      concurrency_key (str | Callable[..., str | None]): The key, or a function called with
        the message's ``*args, **kwargs`` that returns it (None: this message has no key).
      concurrency_limit (int): How many messages of one key may be processing at a time
        (default 1; a run-time limit set with ``dramatiq-pg-outbox limits set`` wins).

    The broker applies them when it enqueues (:func:`apply_actor_options`), where an error
    reaches ``send()``: Dramatiq's ``before_enqueue`` hooks only log theirs.
    """

    actor_options = {"concurrency_key", "concurrency_limit"}


def apply_actor_options(broker: Broker, message: Message[Any]) -> None:
    """Copy the actor's ``concurrency_key`` (called with the arguments if a function) and
    ``concurrency_limit`` into ``message.options``, unless the message has its own.

    Raises:
      ValueError: The key function raised (the message is not sent); its error is named.
    """
    options = message.options
    try:
        actor = broker.get_actor(message.actor_name)
    except ActorNotFound:
        return  # an actor of another process (enqueue_many of prebuilt messages)
    key: str | Callable[..., str | None] | None = actor.options.get("concurrency_key")
    if key is not None and "concurrency_key" not in options:
        if callable(key):
            try:
                key = key(*message.args, **message.kwargs)
            except Exception as e:
                raise ValueError(
                    f"the concurrency_key function of actor {message.actor_name!r} raised "
                    f"{type(e).__name__}: {e}"
                ) from None
        if key is not None:
            options["concurrency_key"] = key
    limit = actor.options.get("concurrency_limit")
    if limit is not None and "concurrency_limit" not in options and "concurrency_key" in options:
        options["concurrency_limit"] = limit


__all__ = ["ConcurrencyKeys", "apply_actor_options"]
