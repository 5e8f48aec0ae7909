"""``dramatiq-pg-outbox limits``: the run-time limits of concurrency keys (migrations 0021, 0023).

``limits`` lists them (with the messages of their keys processing and waiting) and the
busiest keys per queue; ``limits set PREFIX N`` makes at most N messages of each key that
starts with PREFIX process at a time (0 holds them all), before the limit the messages
carry; with ``--queue QUEUE`` the limit is that queue's own, which its claim takes before
a limit of every queue.  ``limits unset PREFIX [--queue QUEUE]`` removes one.  Each change
is audited and wakes the workers of the queues concerned with keyed messages waiting.  The
dashboard's Limits page runs the same statements.  docs/guides/concurrency.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..formats import format_time
from ..names import channel_for
from ..store.admin import limit_target
from .common import (
    EXIT_USAGE,
    CliError,
    checked_connection,
    parse_queue_name,
    print_json,
    print_table,
    record_action,
    whole_number,
)

#: Longest prefix accepted (a concurrency key has at most 200 characters).
MAX_PREFIX = 200


def parse_prefix(text: str) -> str:
    if not text or len(text) > MAX_PREFIX:
        raise argparse.ArgumentTypeError(f"a key prefix has 1 to {MAX_PREFIX} characters, got {len(text)}")
    return text


def parse_limit(text: str) -> int:
    value = whole_number(text, "a whole number of messages")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (hold every message of the keys) or more, got {value}")
    return value


def add_parser(sub: Any, parents: list[Any]) -> None:
    """Register ``limits`` and its subcommands (see ``cli.main._parser``)."""
    limits = sub.add_parser(
        "limits", parents=parents, help="run-time limits of concurrency keys: list, set, unset"
    )
    limits.add_argument("--json", action="store_true", help="print JSON instead of tables")
    limits.add_argument("--prefix", type=parse_prefix, help="only the keys that start with this")
    limits.add_argument(
        "--queue", type=parse_queue_name, help="only this queue's keys, and the limits that apply to it"
    )
    limits.add_argument(
        "--keys", type=int, default=20, metavar="N", help="show the N busiest keys (default: 20; 0: none)"
    )
    limits.set_defaults(run=list_command)
    actions = limits.add_subparsers(dest="limits_action", metavar="ACTION")
    set_ = actions.add_parser("set", parents=parents, help="limit the keys that start with PREFIX")
    set_.add_argument("prefix", type=parse_prefix, metavar="PREFIX", help='a key prefix, e.g. "customer:"')
    set_.add_argument(
        "max_running", type=parse_limit, metavar="N", help="messages processing per key at most"
    )
    set_.add_argument(
        "--queue", type=parse_queue_name, help="a limit of this queue only (default: of every queue)"
    )
    set_.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    set_.set_defaults(run=set_command)
    unset = actions.add_parser("unset", parents=parents, help="remove the run-time limit of PREFIX")
    unset.add_argument("prefix", type=parse_prefix, metavar="PREFIX", help="the prefix of a limit set before")
    unset.add_argument(
        "--queue", type=parse_queue_name, help="the limit of this queue (default: the one of every queue)"
    )
    unset.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    unset.set_defaults(run=unset_command)


def list_command(args: argparse.Namespace) -> int:
    if args.keys < 0:
        raise CliError(f"--keys is 0 or more, not {args.keys}", EXIT_USAGE)
    with checked_connection(args) as (conn, store, _):
        limits = [
            row
            for row in store.limits(conn, queue=args.queue)
            if args.prefix is None or row.prefix.startswith(args.prefix)
        ]
        keys = (
            store.busiest_keys(conn, prefix=args.prefix, limit=args.keys, queue=args.queue)
            if args.keys
            else []
        )
    if args.json:
        print_json(
            {
                "limits": [row.__dict__ for row in limits],
                "keys": [row.__dict__ for row in keys],
            }
        )
        return 0
    if limits:
        print_table(
            [
                (r.queue_name or "(every queue)", r.prefix, r.max_running, r.processing, r.waiting,
                 format_time(r.updated_at))
                for r in limits
            ],
            ["queue", "prefix", "limit", "processing", "waiting", "set at"],
            numeric=(2, 3, 4),
        )  # fmt: skip
    else:
        print("no run-time limit (keys take the limits their messages carry; default 1)")
    if keys:
        print()
        print_table(
            [
                (r.queue_name, r.key, _processing(r.processing, r.processing_everywhere), r.waiting,
                 r.max_running, _limit_source(r.limited_by, r.limit_queue))
                for r in keys
            ],
            ["queue", "key", "processing", "waiting", "limit", "from"],
            numeric=(2, 3, 4),
        )  # fmt: skip
    return 0


def _processing(here: int, everywhere: int) -> str:
    """Processing in the queue, and in others when some are (the claim counts them all)."""
    return str(here) if everywhere == here else f"{here} (+{everywhere - here} elsewhere)"


def _limit_source(prefix: str | None, queue: str | None) -> str:
    if prefix is None:
        return "(message)"
    return f"{prefix}* of {queue}" if queue else f"{prefix}*"


def _current(conn: Any, store: Any, args: argparse.Namespace) -> int | None:
    """The run-time limit of ``args.prefix`` in ``args.queue`` (None: every queue) now."""
    wanted = (args.queue, args.prefix)
    return {(r.queue_name, r.prefix): r.max_running for r in store.limits(conn)}.get(wanted)


def _keys(args: argparse.Namespace) -> str:
    return f"keys {args.prefix!r}*" + (f" of queue {args.queue!r}" if args.queue else "")


def set_command(args: argparse.Namespace) -> int:
    with checked_connection(args) as (conn, store, _):
        if args.dry_run:
            current = _current(conn, store, args)
            was = "none" if current is None else str(current)
            print(f"would set the limit of {_keys(args)} to {args.max_running} (now: {was})")
            print("dry run: nothing changed")
            return 0
        previous, woken = store.set_limit(
            conn, prefix=args.prefix, max_running=args.max_running, channel=channel_for(args.schema),
            queue=args.queue,
        )  # fmt: skip
        record_action(
            conn, args.schema, action="limit-set", target=limit_target(args.prefix, args.queue),
            count=args.max_running, detail=f"previous: {'none' if previous is None else previous}",
        )  # fmt: skip
    was = "none" if previous is None else str(previous)
    print(
        f"set the limit of {_keys(args)} to {args.max_running} (was: {was}); "
        f"woke the workers of {len(woken)} queue(s)"
    )
    return 0


def unset_command(args: argparse.Namespace) -> int:
    with checked_connection(args) as (conn, store, _):
        if args.dry_run:
            current = _current(conn, store, args)
            if current is None:
                raise _no_limit(args)
            print(f"would remove the limit {current} of {_keys(args)}")
            print("dry run: nothing changed")
            return 0
        removed = store.unset_limit(
            conn, prefix=args.prefix, channel=channel_for(args.schema), queue=args.queue
        )
        if removed is None:
            raise _no_limit(args)
        record_action(
            conn,
            args.schema,
            action="limit-unset",
            target=limit_target(args.prefix, args.queue),
            count=removed,
        )
    print(
        f"removed the limit {removed} of {_keys(args)}: "
        "they take another limit or the ones their messages carry"
    )
    return 0


def _no_limit(args: argparse.Namespace) -> CliError:
    return CliError(f"no run-time limit for {_keys(args)} (see: dramatiq-pg-outbox limits)")
