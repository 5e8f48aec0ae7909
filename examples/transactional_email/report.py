"""The example's verdict: compare the signups with what the SMTP server and the broker saw."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import dramatiq
import psycopg
from psycopg import sql


@dataclass
class Outcomes:
    """What happened to the signups (filled from several producer threads)."""

    committed: set[int] = field(default_factory=set)
    rolled_back: set[int] = field(default_factory=set)
    reasons: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def enqueued_user_ids(url: str, schema: str, actor_name: str) -> dict[str, int]:
    """User id of every message of ``actor_name`` the broker stored, by message id.

    Reads the hot table and the history (a retried message has several rows,
    one message id): this is the list of messages that *exist*, whatever
    happened to them afterwards.
    """
    query = sql.SQL(
        "SELECT message_id, payload FROM {s}.messages WHERE actor_name = %(actor)s "
        "UNION ALL SELECT message_id, payload FROM {s}.history WHERE actor_name = %(actor)s"
    ).format(s=sql.Identifier(schema))
    with psycopg.connect(url) as conn:
        rows = conn.execute(query, {"actor": actor_name}).fetchall()
    return {message_id: int(dramatiq.Message.decode(bytes(payload)).args[0]) for message_id, payload in rows}


def report(
    outcomes: Outcomes, received: list[int | None], enqueued: dict[str, int], seconds: float
) -> list[str]:
    """Print the report; return the reasons the run failed (empty if it passed).

    Parameters:
      outcomes: The signups.
      received: The user id of every email the SMTP server received.
      enqueued: The user id of every message the broker stored, by message id.
      seconds: Time from the first signup to the last email.
    """
    emails = Counter(received)
    messages = Counter(enqueued.values())
    committed, rolled_back = outcomes.committed, outcomes.rolled_back
    duplicates = sum(n - 1 for n in emails.values())
    missing = len(committed - emails.keys())
    emails_rolled_back = sum(n for user, n in emails.items() if user in rolled_back)
    messages_rolled_back = sum(n for user, n in messages.items() if user in rolled_back)
    strangers = sum(n for user, n in emails.items() if user not in committed | rolled_back)
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(outcomes.reasons.items()))

    rows = [
        ("signups committed", f"{len(committed)}", ""),
        ("signups rolled back", f"{sum(outcomes.reasons.values())}", f"({reasons})" if reasons else ""),
        ("emails received", f"{len(received)}", ""),
        ("duplicates", f"{duplicates}", ""),
        ("missing", f"{missing}", "(committed signups without an email)"),
        ("emails for rolled-back", f"{emails_rolled_back}", ""),
        ("messages for rolled-back", f"{messages_rolled_back}", "(stored by the broker, delivered or not)"),
        ("elapsed", f"{seconds:.1f} s", "(first signup to last email)"),
        ("throughput", f"{len(received) / seconds:.0f} emails/s" if seconds > 0 else "-", ""),
    ]
    for label, value, note in rows:
        print(f"  {label:<26}{value:>12}  {note}".rstrip())

    problems = []
    if missing:
        problems.append(f"{missing} committed signups got no email (lost messages)")
    if len(received) != len(committed):
        problems.append(f"{len(received)} emails received for {len(committed)} committed signups")
    if duplicates:
        problems.append(
            f"{duplicates} duplicate emails: delivery is at-least-once, so duplicates can only "
            "follow a worker crash, and no worker crashed in this run"
        )
    if emails_rolled_back or messages_rolled_back:
        problems.append(
            f"{messages_rolled_back} messages ({emails_rolled_back} emails) for rolled-back signups: "
            "messages outlived their transaction"
        )
    if strangers:
        problems.append(f"{strangers} emails for users that no signup created")
    return problems
