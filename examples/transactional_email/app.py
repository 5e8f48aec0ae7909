"""The application: signing a user up sends the welcome email in the same transaction."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import outbox

from .models import User
from .tasks import send_welcome_email


class SignupFailed(Exception):
    """A signup was rolled back: neither the user nor its welcome email exists.

    Attributes:
      user_id: The id the user had inside the rolled-back transaction (ids
        come from a sequence and are never reused), or ``None``.
      reason: ``"rejected"`` (the application refused it after sending) or
        ``"duplicate"`` (the database refused the email address at commit).
    """

    def __init__(self, user_id: int | None, reason: str) -> None:
        super().__init__(f"signup of user {user_id} rolled back: {reason}")
        self.user_id = user_id
        self.reason = reason


def sign_up(session: Session, email: str, *, fail: bool = False) -> int:
    """Create the user ``email`` and enqueue its welcome email, in one transaction.

    Parameters:
      session: A session with no transaction in progress; this function commits or rolls back.
      email: The new user's address.
      fail: Simulate a late failure (say, a fraud check) *after* the message was sent.

    Returns:
      The new user's id, once committed.

    Raises:
      SignupFailed: The transaction rolled back, and the message with it.
    """
    user_id: int | None = None
    try:
        with outbox(session):
            user = User(email=email)
            session.add(user)
            session.flush()
            user_id = user.id
            send_welcome_email.send(user_id)
            if fail:
                raise SignupFailed(user_id, "rejected")
        session.commit()
    except SignupFailed:
        session.rollback()
        raise
    except IntegrityError as exc:
        session.rollback()
        raise SignupFailed(user_id, "duplicate") from exc
    except BaseException:
        session.rollback()
        raise
    return user_id
