"""The welcome email: built by the actor, parsed by the SMTP server to count deliveries."""

from __future__ import annotations

from email.message import EmailMessage

#: Sender address of the welcome emails.
SENDER = "welcome@example.com"
#: Header carrying the user id, so the SMTP server can count emails per user.
USER_ID_HEADER = "X-User-Id"


def welcome_email(user_id: int, address: str) -> EmailMessage:
    """Build the welcome email for one user; its Message-ID and a header carry the user id."""
    message = EmailMessage()
    message["From"] = SENDER
    message["To"] = address
    message["Subject"] = "Welcome aboard!"
    message["Message-ID"] = f"<welcome-{user_id}@example.com>"
    message[USER_ID_HEADER] = str(user_id)
    message.set_content(f"Hello {address},\n\nyour account #{user_id} is ready.\n")
    return message
