"""The outbox promise under every SQLAlchemy transaction shape (docs/guarantees.md, the table).

A message exists if and only if the transaction (or savepoint) it was sent in
commits.  Each shape runs on the four binds (Session, AsyncSession, Connection,
AsyncConnection) through one small interpreter of operations.  Two oracles
check every run: a model of the scopes (which sends belong to committed
scopes), and PostgreSQL itself, since a business row is inserted beside many
sends and must be stored exactly when the message is.  A hypothesis test drives
random sequences through the same interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, SchemaNotReady, outbox, upgrade
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from dramatiq_pg_outbox.outbox.hooks import install_engine_listeners

KINDS = ["Session", "AsyncSession", "Connection", "AsyncConnection"]

#: An operation: ("send", tag, with_row) | ("nested",) | ("release",) | ("rollback_nested",)
#: | ("commit",) | ("rollback",) | ("close",) | ("duplicate",) (get-or-create that fails)
#: | ("violate",) (a row that breaks a DEFERRABLE INITIALLY DEFERRED foreign key: the COMMIT fails).
Op = tuple[Any, ...]


def send(tag: str, row: bool = True) -> Op:
    return ("send", tag, row)


NESTED, RELEASE, ROLLBACK_NESTED = ("nested",), ("release",), ("rollback_nested",)
COMMIT, ROLLBACK, CLOSE, DUPLICATE = ("commit",), ("rollback",), ("close",), ("duplicate",)
VIOLATE = ("violate",)


@dataclass
class Model:
    """What must be stored: sends of scopes that committed; savepoint scopes nest."""

    committed: list[str] = field(default_factory=list)
    committed_rows: list[str] = field(default_factory=list)
    stack: list[list[tuple[str, bool]]] = field(default_factory=lambda: [[]])
    #: Per open scope: whether it holds a row that violates the deferred foreign key.
    violated: list[bool] = field(default_factory=lambda: [False])
    #: Whether the last "commit" fails (the interpreter then expects IntegrityError and rolls back).
    commit_fails: bool = False

    def apply(self, op: Op) -> bool:
        """Apply ``op``; False if it is not valid here (the interpreter then skips it)."""
        kind = op[0]
        if kind in ("release", "rollback_nested") and len(self.stack) == 1:
            return False  # no savepoint open
        if kind == "send":
            self.stack[-1].append((op[1], op[2]))
        elif kind == "violate":
            self.violated[-1] = True
        elif kind == "nested":
            self.stack.append([])
            self.violated.append(False)
        elif kind == "release":
            top = self.stack.pop()
            self.stack[-1].extend(top)
            violated = self.violated.pop()
            self.violated[-1] = self.violated[-1] or violated
        elif kind == "rollback_nested":
            self.stack.pop()
            self.violated.pop()
        elif kind == "commit":
            self.commit_fails = any(self.violated)
            if not self.commit_fails:
                sends = [s for scope in self.stack for s in scope]
                self.committed += [tag for tag, _ in sends]
                self.committed_rows += [tag for tag, row in sends if row]
            self.stack, self.violated = [[]], [False]
        elif kind in ("rollback", "close"):
            self.stack, self.violated = [[]], [False]
        return True


#: Breaks shapes_deferred's DEFERRABLE INITIALLY DEFERRED foreign key: checked, and failed, at COMMIT.
VIOLATION = "INSERT INTO shapes_deferred (parent) VALUES (-1)"


class Scenario:
    """Runs operations on one bind kind, inside ``outbox()``, against the test database."""

    def __init__(self, kind: str, url: str, send: Callable[[str], Any]) -> None:
        self.kind = kind
        self.url = url
        self.send = send

    def run(self, ops: list[Op]) -> Model:
        model = Model()
        if self.kind.startswith("Async"):
            asyncio.run(self._run_async(ops, model))
        else:
            self._run_sync(ops, model)
        return model

    # -- sync binds ------------------------------------------------------------
    def _run_sync(self, ops: list[Op], model: Model) -> None:
        engine = create_engine(normalize_sqlalchemy_url(self.url), pool_size=2)
        try:
            with contextlib.ExitStack() as stack:
                bind = self._open_sync(engine, stack)
                nested: list[Any] = []
                for op in ops:
                    if not model.apply(op):
                        continue
                    kind = op[0]
                    if kind == "send":
                        if op[2]:
                            self._execute(bind, op[1])
                        self.send(op[1])
                    elif kind == "nested":
                        nested.append(bind.begin_nested())
                    elif kind == "release":
                        nested.pop().commit()
                    elif kind == "rollback_nested":
                        nested.pop().rollback()
                    elif kind == "duplicate":
                        self._get_or_create_fails(bind)
                    elif kind == "violate":
                        bind.execute(text(VIOLATION))
                    elif kind == "commit" and model.commit_fails:
                        with pytest.raises(IntegrityError, match="shapes_deferred"):
                            bind.commit()
                        bind.rollback()
                        nested.clear()
                    elif kind == "commit":
                        bind.commit()
                        nested.clear()
                    elif kind == "rollback":
                        bind.rollback()
                        nested.clear()
                    elif kind == "close":
                        if isinstance(bind, Session):
                            bind.close()  # the same Session is used again afterwards
                        else:
                            stack.close()
                            bind = self._open_sync(engine, stack)
                        nested.clear()
        finally:
            engine.dispose()

    def _open_sync(self, engine: Engine, stack: contextlib.ExitStack) -> Session | Connection:
        bind: Session | Connection
        if self.kind == "Session":
            bind = stack.enter_context(Session(engine))
        else:
            bind = stack.enter_context(engine.connect())
        stack.enter_context(outbox(bind))
        return bind

    @staticmethod
    def _execute(bind: Session | Connection, tag: str) -> None:
        bind.execute(text("INSERT INTO shapes_rows (tag) VALUES (:tag)"), {"tag": tag})

    @staticmethod
    def _get_or_create_fails(bind: Session | Connection) -> None:
        # The get-or-create idiom: try the insert in a savepoint, catch the conflict.
        if isinstance(bind, Session):
            with contextlib.suppress(IntegrityError), bind.begin_nested():
                bind.execute(text("INSERT INTO shapes_unique (k) VALUES ('taken')"))
            return
        savepoint = bind.begin_nested()
        try:
            bind.execute(text("INSERT INTO shapes_unique (k) VALUES ('taken')"))
        except IntegrityError:
            savepoint.rollback()
        else:
            savepoint.commit()

    # -- async binds -----------------------------------------------------------
    async def _run_async(self, ops: list[Op], model: Model) -> None:
        engine = create_async_engine(normalize_sqlalchemy_url(self.url), pool_size=2)
        try:
            async with contextlib.AsyncExitStack() as stack:
                bind = await self._open_async(engine, stack)
                nested: list[Any] = []
                for op in ops:
                    if not model.apply(op):
                        continue
                    kind = op[0]
                    if kind == "send":
                        if op[2]:
                            await bind.execute(
                                text("INSERT INTO shapes_rows (tag) VALUES (:tag)"), {"tag": op[1]}
                            )
                        self.send(op[1])
                    elif kind == "nested":
                        nested.append(await bind.begin_nested())
                    elif kind == "release":
                        await nested.pop().commit()
                    elif kind == "rollback_nested":
                        await nested.pop().rollback()
                    elif kind == "duplicate":
                        savepoint = await bind.begin_nested()
                        try:
                            await bind.execute(text("INSERT INTO shapes_unique (k) VALUES ('taken')"))
                        except IntegrityError:
                            await savepoint.rollback()
                        else:
                            await savepoint.commit()
                    elif kind == "violate":
                        await bind.execute(text(VIOLATION))
                    elif kind == "commit" and model.commit_fails:
                        with pytest.raises(IntegrityError, match="shapes_deferred"):
                            await bind.commit()
                        await bind.rollback()
                        nested.clear()
                    elif kind == "commit":
                        await bind.commit()
                        nested.clear()
                    elif kind == "rollback":
                        await bind.rollback()
                        nested.clear()
                    elif kind == "close":
                        if isinstance(bind, AsyncSession):
                            await bind.close()  # the same AsyncSession is used again afterwards
                        else:
                            await stack.aclose()
                            bind = await self._open_async(engine, stack)
                        nested.clear()
        finally:
            await engine.dispose()

    async def _open_async(
        self, engine: AsyncEngine, stack: contextlib.AsyncExitStack
    ) -> AsyncSession | AsyncConnection:
        bind: AsyncSession | AsyncConnection
        if self.kind == "AsyncSession":
            bind = await stack.enter_async_context(AsyncSession(engine))
        else:
            bind = await stack.enter_async_context(engine.connect())
        await stack.enter_async_context(outbox(bind))
        return bind


def stored_tags(db: psycopg.Connection[Any], prefix: str, schema: str = "dramatiq") -> list[str]:
    rows = db.execute(
        f"SELECT convert_from(payload, 'UTF8')::jsonb -> 'args' ->> 0 FROM {schema}.messages ORDER BY id"
    ).fetchall()
    return [r[0] for r in rows if r[0] and r[0].startswith(prefix)]


def row_tags(db: psycopg.Connection[Any], prefix: str) -> list[str]:
    rows = db.execute("SELECT tag FROM shapes_rows WHERE tag LIKE %s ORDER BY id", (prefix + "%",)).fetchall()
    return [r[0] for r in rows]


@pytest.fixture
def shapes_db(db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    db.execute(
        "CREATE TABLE IF NOT EXISTS shapes_rows (id bigserial PRIMARY KEY, tag text NOT NULL);"
        "CREATE TABLE IF NOT EXISTS shapes_unique (k text PRIMARY KEY);"
        "INSERT INTO shapes_unique VALUES ('taken') ON CONFLICT DO NOTHING;"
        "CREATE TABLE IF NOT EXISTS shapes_parents (id int PRIMARY KEY);"
        "CREATE TABLE IF NOT EXISTS shapes_deferred"
        " (parent int NOT NULL REFERENCES shapes_parents DEFERRABLE INITIALLY DEFERRED);"
    )
    return db


@pytest.fixture
def actor(broker: PostgresBroker) -> Any:
    @dramatiq.actor(broker=broker, actor_name="shape")
    def shape(tag: str) -> None:
        pass

    return shape


@pytest.fixture(params=KINDS)
def scenario(request: pytest.FixtureRequest, database_url: str, actor: Any, shapes_db: Any) -> Scenario:
    return Scenario(request.param, database_url, actor.send)


def check(scenario: Scenario, db: Any, ops: list[Op], expected: list[str] | None = None) -> Model:
    """Run ``ops`` (their tags prefixed with a fresh prefix) and check the database against the model."""
    prefix = uuid.uuid4().hex[:8] + "-"
    ops = [(op[0], prefix + op[1], *op[2:]) if op[0] == "send" else op for op in ops]
    model = scenario.run(ops)
    if expected is not None:
        assert model.committed == [prefix + tag for tag in expected], "the test's own model disagrees"
    # Messages follow the model, and PostgreSQL agrees: a message exists exactly when the
    # business row written beside it does.
    assert stored_tags(db, prefix) == model.committed
    assert row_tags(db, prefix) == model.committed_rows
    return model


# Each row of the table in docs/guarantees.md, on every bind kind.
SHAPES: dict[str, tuple[list[Op], list[str]]] = {
    "commit stores the message": ([send("a"), COMMIT], ["a"]),
    "rollback leaves no message": ([send("a"), ROLLBACK], []),
    "a released savepoint keeps its messages": ([send("a"), NESTED, send("b"), RELEASE, COMMIT], ["a", "b"]),
    "a rolled-back savepoint drops only its own messages": (
        [send("a"), NESTED, send("b"), ROLLBACK_NESTED, send("c"), COMMIT],
        ["a", "c"],
    ),
    "a rolled-back savepoint without SQL drops its messages": (
        [send("a"), NESTED, send("b", row=False), ROLLBACK_NESTED, send("c"), COMMIT],
        ["a", "c"],
    ),
    "nested savepoints: inner rollback, outer release": (
        [send("a"), NESTED, send("b"), NESTED, send("c"), ROLLBACK_NESTED, RELEASE, send("d"), COMMIT],
        ["a", "b", "d"],
    ),
    "an outer savepoint rollback drops the inner released one": (
        [NESTED, send("a"), NESTED, send("b"), RELEASE, ROLLBACK_NESTED, send("c"), COMMIT],
        ["c"],
    ),
    "get-or-create (savepoint + IntegrityError) keeps earlier messages": (
        [send("a"), DUPLICATE, send("b"), COMMIT],
        ["a", "b"],
    ),
    "close without commit leaves no message, and a later commit writes none": (
        [send("a"), CLOSE, COMMIT, send("b"), CLOSE, send("c"), ROLLBACK, COMMIT],
        [],
    ),
    "rollback before any SQL drops what was sent since the last commit": (
        [send("m1", row=False), COMMIT, send("m2", row=False), ROLLBACK, send("m3", row=False), COMMIT],
        ["m1", "m3"],
    ),
    "commit with an open savepoint commits it too": ([send("a"), NESTED, send("b"), COMMIT], ["a", "b"]),
    "several transactions on one bind": (
        [send("a"), COMMIT, send("b"), ROLLBACK, send("c"), NESTED, send("d"), RELEASE, COMMIT],
        ["a", "c", "d"],
    ),
    "a COMMIT that fails (deferred constraint) stores nothing of its transaction": (
        [send("a"), NESTED, send("b"), RELEASE, VIOLATE, COMMIT, send("c"), COMMIT],
        ["c"],
    ),
    "a deferred violation inside a rolled-back savepoint does not fail the COMMIT": (
        [send("a"), NESTED, VIOLATE, send("b"), ROLLBACK_NESTED, send("c"), COMMIT],
        ["a", "c"],
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_message_exists_iff_its_scope_commits(scenario: Scenario, shapes_db: Any, shape: str) -> None:
    ops, expected = SHAPES[shape]
    check(scenario, shapes_db, ops, expected)


#: Sends and savepoint operations are drawn more often than the ends of transactions.
OPS = st.one_of(
    st.tuples(st.just("send"), st.uuids().map(lambda u: u.hex[:6]), st.booleans()),
    st.sampled_from([NESTED, RELEASE, ROLLBACK_NESTED, NESTED, RELEASE, ROLLBACK_NESTED, DUPLICATE, VIOLATE]),
    st.sampled_from([COMMIT, ROLLBACK, CLOSE]),
)


@pytest.mark.parametrize("kind", KINDS)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, max_size=14))
def test_random_transaction_sequences_store_exactly_the_messages_of_committed_scopes(
    kind: str, database_url: str, actor: Any, shapes_db: Any, ops: list[Op]
) -> None:
    # Every example ends with a commit so that the last scope's verdict is checked too.
    check(Scenario(kind, database_url, actor.send), shapes_db, [*ops, COMMIT])


# -- the same promise in other forms --------------------------------------------


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = create_engine(normalize_sqlalchemy_url(database_url))
    yield engine
    engine.dispose()


async def maybe(value: Any) -> Any:
    """The result of a bind's method: awaited for an async bind, as it is for a sync one."""
    return await value if inspect.isawaitable(value) else value


class Binds:
    """Opens binds of one kind, so that one async test body runs on all four kinds.

    A sync bind is driven from the coroutine too: its calls simply do not need ``await``
    (``await maybe(bind.commit())`` works for both).
    """

    def __init__(self, kind: str, url: str, **engine_options: Any) -> None:
        self.kind = kind
        self.is_async = kind.startswith("Async")
        sa_url = normalize_sqlalchemy_url(url)
        self.engine: Engine | AsyncEngine = (
            create_async_engine(sa_url, **engine_options)
            if self.is_async
            else create_engine(sa_url, **engine_options)
        )

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[Any]:
        """A new bind of this kind, closed (without commit) at the end of the block."""
        engine = self.engine
        if isinstance(engine, AsyncEngine):
            async with AsyncSession(engine) if self.kind == "AsyncSession" else engine.connect() as bind:
                yield bind
        else:
            with Session(engine) if self.kind == "Session" else engine.connect() as bind:
                yield bind

    @contextlib.asynccontextmanager
    async def outbox(self, bind: Any, broker: PostgresBroker | None = None) -> AsyncIterator[None]:
        """``outbox(bind, broker)``, entered with ``async with`` or ``with`` as the bind requires."""
        if self.is_async:
            async with outbox(bind, broker):
                yield
        else:
            with outbox(bind, broker):
                yield

    @classmethod
    def run(
        cls, kind: str, url: str, body: Callable[[Binds], Awaitable[None]], **engine_options: Any
    ) -> None:
        """Run ``body`` in a new event loop, then dispose of the engine in that loop."""

        async def main() -> None:
            binds = cls(kind, url, **engine_options)
            try:
                await body(binds)
            finally:
                await maybe(binds.engine.dispose())

        asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_an_exception_inside_the_block_leaves_the_decision_to_the_transaction(
    kind: str, database_url: str, actor: Any, shapes_db: Any
) -> None:
    prefix = uuid.uuid4().hex[:8] + "-"

    async def body(binds: Binds) -> None:
        # Given an exception raised inside the block, when the transaction then rolls back: no message.
        async with binds.open() as bind:
            with pytest.raises(RuntimeError):
                async with binds.outbox(bind):
                    actor.send(prefix + "lost")
                    raise RuntimeError("signup failed")
            await maybe(bind.rollback())
        # When it commits anyway (the application decided the rest of the transaction stands): stored.
        async with binds.open() as bind:
            with pytest.raises(RuntimeError):
                async with binds.outbox(bind):
                    actor.send(prefix + "kept")
                    raise RuntimeError("a non-fatal error the caller handles")
            await maybe(bind.commit())
        # When the exception also leaves the bind's block (closed without commit): no message.
        with pytest.raises(RuntimeError):
            async with binds.open() as bind, binds.outbox(bind):
                actor.send(prefix + "closed")
                raise RuntimeError("boom")

    Binds.run(kind, database_url, body)
    # Then only the message of the committed transaction exists
    assert stored_tags(shapes_db, prefix) == [prefix + "kept"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_bind_does_not_carry_messages_into_the_next_transaction(
    kind: str, database_url: str, actor: Any, shapes_db: Any
) -> None:
    prefix = uuid.uuid4().hex[:8] + "-"

    async def body(binds: Binds) -> None:
        async with binds.open() as bind:
            # Given a message sent in a transaction that an exception interrupts
            with pytest.raises(RuntimeError):
                async with binds.outbox(bind):
                    await maybe(bind.execute(text("SELECT 1")))  # the transaction has begun
                    actor.send(prefix + "lost")
                    raise RuntimeError("boom")
            # When the bind is closed without commit
            await maybe(bind.close())
            # and an unrelated transaction, outside any outbox block, commits on the same Session
            # (usable again after close()), or on the same pooled DBAPI connection (the pool holds one)
            async with contextlib.AsyncExitStack() as stack:
                again = bind if "Session" in kind else await stack.enter_async_context(binds.open())
                await maybe(again.execute(text("SELECT 1")))
                await maybe(again.commit())

    Binds.run(kind, database_url, body, pool_size=1, max_overflow=0)
    # Then no message exists
    assert stored_tags(shapes_db, prefix) == []


@pytest.mark.parametrize("kind", KINDS)
def test_two_brokers_on_one_bind_write_to_their_own_schemas(
    kind: str, database_url: str, make_broker: Any, shapes_db: Any
) -> None:
    # Given two brokers on two schemas
    upgrade(database_url, schema="shapes_other")
    shapes_db.execute("TRUNCATE shapes_other.messages")
    first = make_broker()
    second = make_broker(schema="shapes_other")
    one = dramatiq.actor(lambda tag: None, broker=first, actor_name="one")
    two = dramatiq.actor(lambda tag: None, broker=second, actor_name="two")
    prefix = uuid.uuid4().hex[:8] + "-"

    async def body(binds: Binds) -> None:
        async with binds.open() as bind:
            # When each broker's messages are sent with one binding per broker, one after the other
            async with binds.outbox(bind, broker=first):
                one.send(prefix + "first")
            async with binds.outbox(bind, broker=second):
                two.send(prefix + "second")
            # and with one binding for every broker
            async with binds.outbox(bind):
                one.send(prefix + "first-again")
                two.send(prefix + "second-again")
                # and in a savepoint that rolls back, after a savepoint inside it began (which makes a
                # Connection write the buffer: the rows exist, then are rolled back)
                savepoint = await maybe(bind.begin_nested())
                one.send(prefix + "first-rolled-back")
                two.send(prefix + "second-rolled-back")
                await maybe((await maybe(bind.begin_nested())).commit())
                await maybe(savepoint.rollback())
            assert stored_tags(shapes_db, prefix) == []
            assert stored_tags(shapes_db, prefix, schema="shapes_other") == []
            await maybe(bind.commit())

    Binds.run(kind, database_url, body)
    # Then each committed message is in its own broker's schema
    assert stored_tags(shapes_db, prefix) == [prefix + "first", prefix + "first-again"]
    assert stored_tags(shapes_db, prefix, schema="shapes_other") == [
        prefix + "second",
        prefix + "second-again",
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_binding_for_one_broker_leaves_another_brokers_sends_alone(
    kind: str, database_url: str, make_broker: Any, shapes_db: Any
) -> None:
    # Given two brokers, and a binding for the first only
    first = make_broker()
    other = make_broker()
    one = dramatiq.actor(lambda tag: None, broker=first, actor_name="one")
    outside = dramatiq.actor(lambda tag: None, broker=other, actor_name="outside")
    prefix = uuid.uuid4().hex[:8] + "-"

    async def body(binds: Binds) -> None:
        async with binds.open() as bind, binds.outbox(bind, broker=first):
            # When both send, then the transaction rolls back
            one.send(prefix + "bound")
            outside.send(prefix + "pool")  # not bound: written at once through its broker's pool
            assert stored_tags(shapes_db, prefix) == [prefix + "pool"]
            await maybe(bind.rollback())

    Binds.run(kind, database_url, body)
    # Then the other broker's message was committed on its own, the bound one rolled back
    assert stored_tags(shapes_db, prefix) == [prefix + "pool"]


@pytest.mark.parametrize("kind", ["Connection", "AsyncConnection", "Session", "AsyncSession"])
def test_after_commit_notify_mode_wakes_listeners_for_every_bind_kind(
    kind: str, database_url: str, make_broker: Any, shapes_db: Any
) -> None:
    broker = make_broker(notify="after_commit")
    actor = dramatiq.actor(lambda tag: None, broker=broker, actor_name="shape")
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{broker.channel}"')
        Scenario(kind, database_url, actor.send).run([send("rolled-back"), ROLLBACK])
        assert list(listener.notifies(timeout=0.5)) == []
        Scenario(kind, database_url, actor.send).run([send("committed"), COMMIT])
        notes = list(listener.notifies(timeout=5.0, stop_after=1))
        assert [n.payload for n in notes] == ["default"]


def test_a_message_is_encoded_when_it_is_sent(engine: Engine, broker: PostgresBroker, shapes_db: Any) -> None:
    @dramatiq.actor(broker=broker, actor_name="record")
    def record(data: dict[str, Any]) -> None:
        pass

    prefix = uuid.uuid4().hex[:8] + "-"
    with Session(engine) as session:
        with outbox(session):
            data = {"tag": prefix + "before"}
            record.send(data)
            data["tag"] = prefix + "after"  # changed after send(): not what is stored
            # An argument the encoder cannot take fails at send(), not at commit.
            with pytest.raises(TypeError):
                record.send({"tag": object()})
        session.commit()
    rows = shapes_db.execute(
        "SELECT convert_from(payload, 'UTF8')::jsonb -> 'args' -> 0 ->> 'tag' FROM dramatiq.messages"
    ).fetchall()
    assert [r[0] for r in rows if r[0].startswith(prefix)] == [prefix + "before"]


class RecordEnqueues(dramatiq.Middleware):
    def __init__(self) -> None:
        self.after: list[Any] = []

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.after.append(message.args[0])


@pytest.mark.parametrize("kind", KINDS)
def test_after_enqueue_runs_only_for_messages_that_were_stored(
    kind: str, database_url: str, make_broker: Any, shapes_db: Any
) -> None:
    # Given a broker with a middleware that records after_enqueue
    recorder = RecordEnqueues()
    broker = make_broker()
    broker.add_middleware(recorder)
    actor = dramatiq.actor(lambda tag: None, broker=broker, actor_name="shape")
    keyed = dramatiq.actor(lambda tag: None, broker=broker, actor_name="keyed")
    key = uuid.uuid4().hex

    def send_tag(tag: str) -> Any:
        # Tags ending in "-dup" share one idempotency key: only the first is stored.
        if tag.endswith("-dup"):
            return keyed.send_with_options(args=(tag,), idempotency_key=key)
        return actor.send(tag)

    # When messages are sent in transactions of every outcome
    prefix = uuid.uuid4().hex[:8] + "-"
    ops = [
        send(prefix + "rolled-back"),
        ROLLBACK,
        send(prefix + "committed"),
        send(prefix + "first-dup"),
        COMMIT,
        send(prefix + "second-dup"),  # same key as an earlier message: not stored
        COMMIT,
        send(prefix + "commit-fails"),
        VIOLATE,
        COMMIT,  # the COMMIT itself fails: a deferred foreign key
        send(prefix + "kept"),
        NESTED,
        send(prefix + "in-a-rolled-back-savepoint"),
        ROLLBACK_NESTED,
        COMMIT,
        # A Connection writes its buffer when a savepoint begins: this message is written
        # inside the outer savepoint, then rolled back with it.
        NESTED,
        send(prefix + "written-then-rolled-back"),
        NESTED,
        RELEASE,
        ROLLBACK_NESTED,
        send(prefix + "after"),
        COMMIT,
    ]
    Scenario(kind, database_url, send_tag).run(ops)
    # Then PostgreSQL kept the business rows of the committed transactions, and their messages
    # but the duplicate
    expected = [prefix + tag for tag in ("committed", "first-dup", "kept", "after")]
    assert row_tags(shapes_db, prefix) == [*expected[:2], prefix + "second-dup", *expected[2:]]
    assert stored_tags(shapes_db, prefix) == expected
    # and after_enqueue ran for exactly those messages, each once
    assert sorted(recorder.after) == sorted(expected)


def test_outbox_on_a_database_that_was_never_migrated_raises_schema_not_ready(
    admin_url: str, make_broker: Any
) -> None:
    from dramatiq_pg_outbox.testing import scratch_database

    with scratch_database(admin_url, "dpo_test_bare") as bare_url:
        # Given an engine on a database the broker's tables were never migrated into, whose URL
        # carries the password as a query parameter (a trust-auth server ignores a made-up one)
        url = normalize_sqlalchemy_url(bare_url)
        password = url.password or "secret-Pa55"
        url = url.set(password=None).update_query_dict({"password": password})
        broker = make_broker()
        actor = dramatiq.actor(lambda: None, broker=broker, actor_name="nowhere")
        engine = create_engine(url)
        try:
            errors = []
            # When a message is committed through a Session, then through a Connection
            with Session(engine) as session:
                with outbox(session):
                    actor.send()
                with pytest.raises(SchemaNotReady) as raised:
                    session.commit()
                errors.append(str(raised.value))
            with engine.connect() as conn:
                with outbox(conn):
                    actor.send()
                with pytest.raises(SchemaNotReady) as raised:
                    conn.commit()
                errors.append(str(raised.value))
        finally:
            engine.dispose()
    # Then each error names the command to run, with the database's URL, but never the password
    masked = url.render_as_string(hide_password=False).replace(password, "***")
    for error in errors:
        assert password not in error
        assert f"Run: dramatiq-pg-outbox migrate --url '{masked}' --schema dramatiq" in error
        assert "<DATABASE_URL>" not in error


# -- a send from a listener of the transaction's end ----------------------------------------------

#: (listener, how the transaction ends) per bind kind.  A Session's after_* events fire once the
#: database transaction has ended; a Connection's commit and rollback events fire just before
#: COMMIT / ROLLBACK is sent.  "savepoint": a savepoint rolls back, then the transaction commits.
END_HOOKS = {
    "Session": [
        ("after_commit", "commit"),
        ("after_transaction_end", "commit"),
        ("after_rollback", "rollback"),
        ("after_soft_rollback", "rollback"),
        ("after_transaction_end", "rollback"),
        ("after_rollback", "savepoint"),
        ("after_soft_rollback", "savepoint"),
    ],
    "Connection": [("commit", "commit"), ("rollback", "rollback"), ("rollback_savepoint", "savepoint")],
}


@pytest.mark.parametrize(
    ("kind", "order", "hook", "ending"),
    [
        (kind, order, hook, ending)
        for kind in KINDS
        for order in ("before", "after")
        for hook, ending in END_HOOKS["Session" if "Session" in kind else "Connection"]
    ],
)
def test_a_send_from_a_listener_of_the_transactions_end_is_stored_once(
    kind: str, order: str, hook: str, ending: str, database_url: str, make_broker: Any, shapes_db: Any
) -> None:
    # Given a broker whose middleware records after_enqueue, and an application listener of the
    # end of the transaction (run before or after the outbox's own listeners) that sends a message
    recorder = RecordEnqueues()
    broker = make_broker()
    broker.add_middleware(recorder)
    actor = dramatiq.actor(lambda tag: None, broker=broker, actor_name="shape")
    prefix = uuid.uuid4().hex[:8] + "-"
    sent: list[str] = []

    def listener(*args: Any) -> None:
        if not sent:
            sent.append(hook)
            actor.send(prefix + "from-listener")

    async def body(binds: Binds) -> None:
        async with binds.open() as bind:
            if "Session" in kind:
                # The outbox listens on the Session class: a listener inserted there runs before
                # its own, one on the session (the AsyncSession's sync_session) after them.
                session = bind.sync_session if isinstance(bind, AsyncSession) else bind
                target: Any = Session if order == "before" else session
                event.listen(target, hook, listener, insert=order == "before")
            else:
                # The outbox listens on each engine from its first send there: this one is new.
                target = binds.engine.sync_engine if isinstance(binds.engine, AsyncEngine) else binds.engine
                if order == "after":
                    install_engine_listeners(target)
                event.listen(target, hook, listener)
            try:
                # When a transaction inside outbox() sends a message and ends
                async with binds.outbox(bind):
                    actor.send(prefix + "in-transaction")
                    await maybe(bind.execute(text("SELECT 1")))
                    if ending == "savepoint":
                        savepoint = await maybe(bind.begin_nested())
                        await maybe(bind.execute(text("SELECT 1")))
                        await maybe(savepoint.rollback())
                    await maybe(bind.rollback() if ending == "rollback" else bind.commit())
            finally:
                event.remove(target, hook, listener)

    Binds.run(kind, database_url, body)
    # Then the listener's message is stored (and the transaction's own, if it committed), and
    # after_enqueue ran for each once
    assert sent == [hook]
    expected = [prefix + "in-transaction"] * (ending != "rollback") + [prefix + "from-listener"]
    assert stored_tags(shapes_db, prefix) == expected
    assert sorted(recorder.after) == sorted(expected)
