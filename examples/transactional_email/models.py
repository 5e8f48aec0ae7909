"""The application's data: a ``users`` table, with SQLAlchemy 2.x."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Engine, String, UniqueConstraint, create_engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


class Base(DeclarativeBase):
    """Declarative base of the example's models."""


class User(Base):
    """A signed-up user.

    The unique constraint on ``email`` is checked at commit (``DEFERRED``), so a
    duplicate signup gets through ``flush()`` and ``send()`` and is then
    rejected by the database itself, taking its message down with it.
    """

    __tablename__ = "users"
    __table_args__ = (
        UniqueConstraint("email", name="users_email_key", deferrable=True, initially="DEFERRED"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(254))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


def engine_for(url: str, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine on ``url`` that uses the psycopg 3 driver (``postgresql+psycopg``)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return create_engine(parsed, **kwargs)


def create_tables(engine: Engine) -> None:
    """Create the application's tables (the broker's come from ``dramatiq_pg_outbox.upgrade``)."""
    Base.metadata.create_all(engine)


def load_user_email(engine: Engine, user_id: int) -> str | None:
    """The email address of user ``user_id``, or ``None`` if there is no such user."""
    with Session(engine) as session:
        return session.scalar(select(User.email).where(User.id == user_id))
