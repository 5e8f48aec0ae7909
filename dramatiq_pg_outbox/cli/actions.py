"""The dashboard's buttons as subcommands: ``cancel``, ``purge``, ``discard``, ``run-now``.

Each runs the dashboard's own statement through the dashboard's
:class:`~dramatiq_pg_outbox.dashboard.store.Store` (one pooled connection,
``asyncio.run``), with the same retries for rows the ring moved meanwhile, so
that a button and its command cannot drift apart.  ``--dry-run`` reads what
the command would change and changes nothing.  Every command prints one line
per message or queue, and ends with exit 1 naming what it could not find.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..formats import format_time
from ..names import channel_for
from .common import (
    EXIT_USAGE,
    PROG,
    CliError,
    checked_connection,
    clip,
    log_action,
    operator_name,
    parse_positive_int,
    parse_queue_name,
    print_json,
    print_table,
    selection_text,
)

T = TypeVar("T")


def add_parsers(sub: Any, common: Any) -> None:
    """Register the subcommands (see ``cli.main._parser``)."""
    cancel = sub.add_parser(
        "cancel",
        parents=[common],
        help="cancel messages: waiting ones now, running ones through their worker (history: canceled)",
    )
    cancel.add_argument("ids", nargs="+", type=parse_positive_int, metavar="ID", help="a message's row id")
    cancel.add_argument("--reason", help="stored as the canceled message's error (default: who and when)")
    cancel.add_argument("--dry-run", action="store_true", help="say what would be canceled, change nothing")
    cancel.set_defaults(run=cancel_command)

    purge = sub.add_parser("purge", parents=[common], help="delete the waiting messages of a queue")
    purge.add_argument("queue", type=parse_queue_name, metavar="QUEUE", help="a queue name")
    purge.add_argument("--dry-run", action="store_true", help="say how many would go, change nothing")
    purge.set_defaults(run=purge_command)

    discard = sub.add_parser("discard", parents=[common], help="delete dead letters for good")
    discard.add_argument("ids", nargs="*", type=parse_positive_int, metavar="ID", help="a dead letter's id")
    discard.add_argument("--queue", type=parse_queue_name, help="every dead letter of this queue")
    discard.add_argument("--actor", help="every dead letter of this actor")
    discard.add_argument("--dry-run", action="store_true", help="say what would go, change nothing")
    discard.set_defaults(run=discard_command)

    run_now = sub.add_parser("run-now", parents=[common], help="make delayed messages due now")
    run_now.add_argument("ids", nargs="+", type=parse_positive_int, metavar="ID", help="a message's row id")
    run_now.add_argument("--dry-run", action="store_true", help="say which are delayed, change nothing")
    run_now.set_defaults(run=run_now_command)

    history = sub.add_parser(
        "history", parents=[common], help="finished messages, newest first (the dashboard's History)"
    )
    history.add_argument("--since", default="24h", help="finished at or after: an age (90m, 6h, 2d) or "
                         "an ISO time, UTC unless it says (default: 24h)")  # fmt: skip
    history.add_argument("--until", help="finished before: an age or an ISO time (default: now)")
    history.add_argument("--queue", type=parse_queue_name, help="only this queue")
    history.add_argument("--actor", help="only this actor")
    history.add_argument("--state", choices=("completed", "failed", "canceled"), help="only this outcome")
    history.add_argument("--message-id", help="only the rows of this Dramatiq message id")
    history.add_argument("--args", metavar="TEXT", help="arguments containing TEXT (Dramatiq's JSON "
                         'encoder only; "TEXT" in double quotes: a whole string value)')  # fmt: skip
    history.add_argument("--limit", type=parse_positive_int, default=50, help="rows (default: 50)")
    history.add_argument("--json", action="store_true", help="print JSON instead of a table")
    history.set_defaults(run=history_command)


def with_store(
    args: argparse.Namespace,
    use: Callable[[Any], Awaitable[T]],
    audit: Callable[[T], dict[str, Any] | None] | None = None,
) -> T:
    """``use(store)`` on the dashboard's store of the schema, once the schema is checked.

    ``audit(result)`` gives the audit row of what ``use`` did (``action``, ``target``,
    ``count``, optionally ``detail``), written on the same connection; none for a dry run.
    """
    import asyncio

    from ..dashboard.store import Store

    with checked_connection(args) as (_, _, db):
        pass

    async def run() -> T:
        store = Store(db.conninfo, args.schema, channel_for(args.schema), max_size=1)
        await store.open()
        try:
            result = await use(store)
            entry = None if audit is None or getattr(args, "dry_run", False) else audit(result)
            if entry is not None:
                operator = operator_name()
                await store.record_audit(operator=operator, source="cli", **entry)
                log_action(operator, "cli", entry["action"], entry["target"], entry["count"])
            return result
        finally:
            await store.close()

    return asyncio.run(run())


def _missing(what: str, ids: list[int], args: argparse.Namespace) -> CliError:
    listed = ", ".join(map(str, ids))
    return CliError(f"{what} {listed} in schema {args.schema!r} (see: {PROG} status, or the dashboard)")


def cancel_command(args: argparse.Namespace) -> int:
    """``cancel``: a waiting message is archived as canceled; a running one is stopped by its worker.

    One line per message canceled (or being canceled); exit 1 naming each message left
    alone: finished already (its outcome and when) or unknown.
    """
    from ..dashboard.store import CancelResult

    now = format_time(dt.datetime.now(dt.timezone.utc))
    reason = args.reason or f"canceled by {getpass.getuser()} with {PROG} cancel at {now}"

    async def would(store: Any, row_id: int) -> CancelResult:
        row = await store.message(row_id)
        if row is not None:
            outcome = "canceled" if row.state == "pending" else "canceling"
            return CancelResult(queue_name=row.queue_name, outcome=outcome)
        done = await store.finished_message(row_id)
        if done is None:
            return CancelResult(queue_name=None, outcome=None)
        return CancelResult(None, None, finished_state=done.state, finished_at=done.finished_at)

    async def use(store: Any) -> list[tuple[int, CancelResult]]:
        return [
            (row_id, await (would(store, row_id) if args.dry_run else store.cancel_message(row_id, reason)))
            for row_id in args.ids
        ]

    def audited(results: list[tuple[int, CancelResult]]) -> dict[str, Any]:
        count = sum(result.outcome is not None for _, result in results)
        return {"action": "cancel", "target": ", ".join(map(str, args.ids)), "count": count, "detail": reason}

    results = with_store(args, use, audited)
    left = []
    for row_id, result in results:
        queue = result.queue_name
        if result.outcome == "canceled":
            verb = "would cancel" if args.dry_run else "canceled"
            print(f"{verb} message {row_id} of queue {queue!r}: waiting, now in history as canceled")
        elif result.outcome == "canceling":
            if args.dry_run:
                print(f"would cancel message {row_id} of queue {queue!r}: running, its worker would stop it")
            else:
                print(
                    f"canceling message {row_id} of queue {queue!r}: its worker "
                    f"({result.worker or 'gone: the rescuer archives it'}) stops its actor; "
                    "it ends in history as canceled"
                )
        elif result.finished_state is not None and result.finished_at is not None:
            when = format_time(result.finished_at)
            left.append(f"message {row_id} already finished ({result.finished_state}) at {when}")
        else:
            left.append(f"no message {row_id} (never stored, or pruned)")
    if args.dry_run:
        print("dry run: nothing changed")
    if left:
        raise CliError(f"not canceled: {'; '.join(left)} in schema {args.schema!r}")
    return 0


def _each_message(
    args: argparse.Namespace,
    *,
    action: str,
    act: Callable[[Any, int], Awaitable[str | None]],
    would: Callable[[Any], bool],
    did: tuple[str, str, str],
    missing: str,
    detail: str = "",
) -> int:
    """Run ``act(store, id)`` (its queue, or None if the row was not in the state it needs) per id.

    A dry run reads each row instead and keeps those that ``would(row)`` accept.  One line per
    row acted on (``did``: the dry run's verb, the verb, what became of it), one audit row
    (not for a dry run), exit 1 naming the ids left alone.
    """

    async def use(store: Any) -> list[tuple[int, str | None]]:
        done = []
        for row_id in args.ids:
            if args.dry_run:
                row = await store.message(row_id)
                done.append((row_id, row.queue_name if row is not None and would(row) else None))
            else:
                done.append((row_id, await act(store, row_id)))
        return done

    def audited(results: list[tuple[int, str | None]]) -> dict[str, Any]:
        count = sum(queue_name is not None for _, queue_name in results)
        return {"action": action, "target": ", ".join(map(str, args.ids)), "count": count, "detail": detail}

    results = with_store(args, use, audited)
    acted = [(row_id, queue_name) for row_id, queue_name in results if queue_name is not None]
    for row_id, queue_name in acted:
        print(f"{did[0] if args.dry_run else did[1]} message {row_id} of queue {queue_name!r}: {did[2]}")
    if args.dry_run:
        print("dry run: nothing changed")
    left = [row_id for row_id, queue_name in results if queue_name is None]
    if left:
        raise _missing(missing, left, args)
    return 0


def purge_command(args: argparse.Namespace) -> int:
    async def use(store: Any) -> int:
        if args.dry_run:
            rows = {q.queue_name: q for q in await store.queues()}
            row = rows.get(args.queue)
            return 0 if row is None else int(row.pending) + int(row.delayed)
        return int(await store.purge_queue(args.queue))

    n = with_store(args, use, lambda n: {"action": "purge", "target": args.queue, "count": n})
    if args.dry_run:
        print(f"would delete {n} waiting message(s) of queue {args.queue!r} (running ones finish)")
        print("dry run: nothing changed")
    else:
        print(f"deleted {n} waiting message(s) of queue {args.queue!r} (running ones finish)")
    return 0


def discard_command(args: argparse.Namespace) -> int:
    from ..dashboard.store import FailedFilter

    if not args.ids and args.queue is None and args.actor is None:
        raise CliError("name the dead letters: their ids, or --queue and/or --actor", EXIT_USAGE)
    if args.ids and (args.queue is not None or args.actor is not None):
        raise CliError("give either ids or --queue/--actor, not both", EXIT_USAGE)
    where = FailedFilter(queue_name=args.queue, actor_name=args.actor)

    async def use(store: Any) -> dict[str, int]:
        if args.dry_run:
            if args.ids:
                found = [await store.finished_message(row_id) for row_id in args.ids]
                queues = [d.queue_name for d in found if d is not None and d.state == "failed"]
            else:
                queues = [r.queue_name for r in await store.failed(where, limit=1_000_000, offset=0)]
            return {q: queues.count(q) for q in sorted(set(queues))}
        gone: dict[str, int] = await store.discard_failed(args.ids or None, where)
        return gone

    target = ", ".join(map(str, args.ids)) if args.ids else selection_text(args)
    gone = with_store(
        args, use, lambda gone: {"action": "discard", "target": target, "count": sum(gone.values())}
    )
    total = sum(gone.values())
    per_queue = ", ".join(f"{q}: {n}" for q, n in sorted(gone.items()))
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {total} dead letter(s) for good" + (f" ({per_queue})" if per_queue else ""))
    if args.dry_run:
        print("dry run: nothing changed")
    if args.ids and total < len(set(args.ids)):
        raise CliError(
            f"only {total} of the {len(set(args.ids))} ids are dead letters in schema {args.schema!r}"
        )
    return 0


def run_now_command(args: argparse.Namespace) -> int:
    return _each_message(
        args,
        action="run-now",
        act=lambda store, row_id: store.run_now(row_id),
        would=lambda row: row.state == "pending" and row.due_in_s > 0,
        did=("would make", "made", "due now (its workers woken)"),
        missing="no delayed message with id",
    )


def history_command(args: argparse.Namespace) -> int:
    """``history``: the History page's search (the same statement), newest first."""
    from ..dashboard.store import HISTORY_SEARCH_TIMEOUT_MS, HistoryFilter, args_preview, parse_time

    async def search(store: Any) -> tuple[list[Any], HistoryFilter]:
        now = await store.now()
        try:
            since = parse_time(args.since, now)
            until = parse_time(args.until, now) if args.until else None
        except ValueError as e:
            raise CliError(str(e), EXIT_USAGE) from None
        where = HistoryFilter(
            since=since, until=until, queue_name=args.queue, actor_name=args.actor, state=args.state,
            message_id=args.message_id, args=args.args,
        )  # fmt: skip
        return await store.history(where, args.limit), where

    import psycopg

    try:
        rows, where = with_store(args, search)
    except psycopg.errors.QueryCanceled:
        raise CliError(
            f"the search ran longer than {HISTORY_SEARCH_TIMEOUT_MS / 1000:g} s: "
            "narrow --since/--until, or name --actor or --queue"
        ) from None
    if args.json:
        print_json(
            [
                {
                    "id": r.id,
                    "queue": r.queue_name,
                    "actor": r.actor_name,
                    "message_id": r.message_id,
                    "outcome": r.outcome,
                    "attempts": r.attempts,
                    "enqueued_at": r.enqueued_at,
                    "started_at": r.started_at,
                    "finished_at": r.finished_at,
                    "error_type": r.error_type,
                    "error": r.error_line or None,
                    "args": args_preview(r.payload_head),
                }
                for r in rows
            ]
        )
        return 0
    if not rows:
        print(f"no finished message matches since {format_time(where.since)} in schema {args.schema!r}")
        return 0
    print_table(
        [
            (
                r.id,
                format_time(r.finished_at),
                r.queue_name,
                r.actor_name,
                r.outcome,
                r.attempts,
                clip(r.args_preview, 40),
                clip(r.error_line, 60),
            )
            for r in rows
        ],
        ["id", "finished", "queue", "actor", "outcome", "attempts", "arguments", "error"],
        numeric=(0, 5),
    )
    return 0
