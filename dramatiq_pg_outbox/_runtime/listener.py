"""One LISTEN connection per process and database: :func:`subscribe`.

Consumers (the broker's channel), result waiters (the results channel) and the
relay (the broker's channel) of one process share one connection per database
(``conninfo``), opened with the first subscription and closed with the last.
A notification only wakes its subscribers early; correctness never depends on
it.  After every (re)connection each subscriber's ``on_connect`` runs once its
channel is listened to: whatever was sent meanwhile was not heard, so it polls.

A new subscription wakes the listener's thread at once (a byte on a socket pair
that it waits on beside the connection), and :func:`subscribe` returns once its
LISTEN is in force, not at the listener's next tick: a notification sent after
``subscribe()`` returned is heard (a barrier's second party, sent a few
milliseconds after the first party subscribed, was heard up to 0.5 s late).

Behind a pooler that shares server connections between clients (PgBouncer in
transaction or statement pooling), a LISTEN runs on some server connection that
then goes back to the pool: the listener hears nothing, each notification goes to
whichever client holds that server connection (psycopg keeps it in that
connection's backlog, unbounded) or is dropped by PgBouncer, and nothing reports an
error.  So the first connection of each listener runs :func:`probe_listen` before
it LISTENs to anything; when it finds such a pooler it logs one warning per process
and database, closes the connection and listens no more (every subscriber polls, as
with ``listen=False``); the verdict is kept for the process's later listeners.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from psycopg.conninfo import conninfo_to_dict

from .._isolation import behind_pooler, connect
from ..store.messages import listen, notify_channel, unlisten
from .service import Service

if TYPE_CHECKING:
    import psycopg

#: Seconds a listener waits for notifications before it looks at new subscriptions.
LISTEN_TICK_S = 0.5
#: Longest wait after a failed connection, in seconds (the first is 0.2 s).
RECONNECT_MAX_S = LISTEN_TICK_S
#: Longest time :func:`subscribe` waits for its LISTEN while the listener connects, in seconds.
SUBSCRIBE_WAIT_S = 2.0
#: Longest time :func:`probe_listen` waits for its second connection's NOTIFY to commit, in seconds.
PROBE_NOTIFY_WAIT_S = 0.5
#: Longest time :func:`probe_listen` waits, once that NOTIFY committed, to hear it, in seconds.
PROBE_HEAR_WAIT_S = 0.5

#: What :func:`probe_listen` found: ``direct`` (no pooler: the backend's pid is the one
#: announced at connect), ``session`` (a pooler, and the probe's notification came back:
#: LISTEN works), ``shared`` (a pooler that shares server connections between clients:
#: LISTEN is useless), ``unknown`` (the probe's NOTIFY did not commit in time or failed).
ListenProbe = Literal["direct", "session", "shared", "unknown"]

#: The warning logged once per process and database when the probe finds ``shared``.
SHARED_WARNING = (
    "LISTEN cannot work through %s: it shares server connections between clients "
    "(PgBouncer in transaction or statement pooling; the listener's probe notification "
    "reached another client or none), so this process polls instead of listening; "
    "pass PostgresBroker(listen=False) to skip the probe and this warning"
)


class Subscription:
    """One subscriber's channel on the process's listener.

    Attributes:
      channel(str): The channel listened to.
      connected(threading.Event): Set while its LISTEN is in force, cleared on a disconnect.
      received(int): Notifications delivered to it.
    """

    def __init__(
        self,
        listener: _Listener,
        channel: str,
        on_notify: Callable[[str], None],
        on_connect: Callable[[], None],
    ) -> None:
        self.listener = listener
        self.channel = channel
        self.on_notify = on_notify
        self.on_connect = on_connect
        self.connected = threading.Event()
        #: Set once its LISTEN is in force, or once the listener gave up (see probe_listen).
        self.settled = threading.Event()
        self.received = 0

    def close(self) -> None:
        """Stop receiving; the last subscription of a listener closes its connection."""
        _unsubscribe(self)


class _Listener(Service):
    """The LISTEN connection of one process to one database, fanned out to its subscriptions."""

    name = "listener"

    def __init__(self, conninfo: str) -> None:
        super().__init__(LISTEN_TICK_S, backoff_max=RECONNECT_MAX_S)
        self.conninfo = conninfo
        self.pid = os.getpid()
        self.subscriptions: list[Subscription] = []
        #: Channels the connection listens to right now.
        self.listening: set[str] = set()
        #: The LISTEN connection while it is open (its statements run at READ COMMITTED, as every
        #: connection of the package: ``_isolation``).
        self.connection: psycopg.Connection[Any] | None = None
        #: What :func:`probe_listen` found on the first connection (None: not probed yet).
        self.probe: ListenProbe | None = None
        #: Set when the probe found a pooler that shares server connections: never listens.
        self.shared = False
        self._lock = threading.Lock()
        # Written to by nudge(), waited on beside the connection: a new subscription or a
        # stop ends the wait at once instead of at the next tick.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def snapshot(self) -> list[Subscription]:
        with self._lock:
            return list(self.subscriptions)

    def log_failure(self, error: Exception, delay: float) -> None:
        self.logger.warning(
            "LISTEN connection lost (attempt %d), subscribers poll until it is back in %.2fs: %s",
            self.failures,
            delay,
            error,
        )

    def run_once(self) -> int:
        """Connect, probe once, LISTEN, deliver until stopped or disconnected; the notifications delivered."""
        known = _verdicts.get((self.pid, self.conninfo))
        if known == "shared":
            self._give_up()
            return 0
        conn = self.connection = connect(
            self.conninfo, autocommit=True, application_name=f"dramatiq-pg-outbox:{os.getpid()}:listen"
        )
        delivered = 0
        try:
            if known is None:
                # Once per process and database (again after an unknown, at the next connection).
                self.probe = probe_listen(conn, self.conninfo)
                if self.probe == "shared":
                    self._found_shared()
                    return 0
                if self.probe != "unknown":
                    _verdicts[(self.pid, self.conninfo)] = self.probe
            else:
                self.probe = known
            while not self.stopping:
                self._listen_new(conn)
                # The backlog first: notifications that came in with a LISTEN's reply.
                for note in conn.notifies(timeout=0):
                    delivered += self._deliver(note)
                wake = self._wake_r.fileno()
                readable, _, _ = select.select([conn.fileno(), wake], [], [], self.interval)
                if wake in readable:
                    self._drain_wake()
        finally:
            with self._lock:
                self.listening.clear()
            for sub in self.snapshot():
                sub.connected.clear()
            self.connection = None
            conn.close()
        return delivered

    def _found_shared(self) -> None:
        """Log the probe's finding once per process and database, then give up."""
        key = (self.pid, self.conninfo)
        with _registry_lock:
            first = _verdicts.get(key) != "shared"
            _verdicts[key] = "shared"
        if first:
            self.logger.warning(SHARED_WARNING, _where(self.conninfo))
        self._give_up()

    def _give_up(self) -> None:
        """Listen no more: every subscription stays disconnected (its subscriber polls)."""
        with self._lock:
            self.shared = True
            subs = list(self.subscriptions)
        self._stopping.set()
        for sub in subs:
            sub.settled.set()

    def _listen_new(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        """LISTEN to the channels of new subscriptions, mark them in force, then call their ``on_connect``."""
        fresh = []
        for sub in self.snapshot():
            if sub.channel not in self.listening:
                listen(conn, channel=sub.channel)
                with self._lock:
                    self.listening.add(sub.channel)
        # Every LISTEN first, then the callbacks: a subscriber's on_connect may wait on a lock
        # held by a thread that waits, in subscribe(), for another subscription to be in force.
        for sub in self.snapshot():
            if not sub.connected.is_set():
                sub.connected.set()
                sub.settled.set()
                fresh.append(sub)
        for sub in fresh:
            # Anything sent before this LISTEN was not heard: look now.
            sub.on_connect()

    def _deliver(self, note: psycopg.Notify) -> int:
        delivered = 0
        for sub in self.snapshot():
            if sub.channel == note.channel and sub.connected.is_set():
                sub.received += 1
                delivered += 1
                sub.on_notify(note.payload)
        return delivered

    def nudge(self) -> None:
        """End the listener's current wait at once (a new subscription, a stop)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed (the listener has ended)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass  # nothing left (BlockingIOError)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self.nudge()
        super().stop(timeout)

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            self._wake_r.close()
            self._wake_w.close()

    def next_delay(self) -> float:
        return 0.0


#: (pid, conninfo) -> the listener of this process for that database.
_listeners: dict[tuple[int, str], _Listener] = {}
#: (pid, conninfo) -> what the probe of this process found there (not ``unknown``).
_verdicts: dict[tuple[int, str], ListenProbe] = {}
_registry_lock = threading.Lock()


def _where(conninfo: str) -> str:
    """Host, port and database of ``conninfo`` for a log line (no user, no password)."""
    try:
        params = conninfo_to_dict(conninfo)
    except Exception:
        return "this database"
    return f"{params.get('host') or 'localhost'}:{params.get('port') or 5432}/{params.get('dbname') or ''}"


def listen_probe(conninfo: str) -> ListenProbe | None:
    """What the listener's probe found for ``conninfo`` in this process (None: not probed, or unknown).

    Parameters:
      conninfo(str): libpq connection string of the database (``broker.conninfo``).
    """
    return _verdicts.get((os.getpid(), conninfo))


def probe_listen(
    conn: psycopg.Connection[Any],
    conninfo: str,
    *,
    notify_wait: float = PROBE_NOTIFY_WAIT_S,
    hear_wait: float = PROBE_HEAR_WAIT_S,
) -> ListenProbe:
    """Whether a LISTEN on ``conn`` is heard: ``direct``, ``session``, ``shared`` or ``unknown``.

    On a direct connection (the backend's pid is the one announced at connect,
    ``_isolation.behind_pooler``) nothing more is done: ``direct``.  Behind a pooler
    (PgBouncer announces a key of its own in every pool mode), ``conn`` LISTENs on a
    fresh channel and a second connection to ``conninfo`` NOTIFYs it:

    - ``conn`` hears it: its server connection is its own (session pooling): ``session``;
    - the second connection hears it itself: it ran on the server connection of the
      LISTEN, which ``conn`` had handed back: ``shared`` at once.  This is what a
      transaction pool with one server connection (``default_pool_size = 1``) or a quiet
      pool (PgBouncer hands out the server connection released last) does;
    - nobody hears it within ``hear_wait`` seconds of its commit: the server connection
      of the LISTEN was idle in the pool (PgBouncer logs "got packet 'A' from server when
      not linked" and drops it) or another client's: ``shared``;
    - the NOTIFY did not commit within ``notify_wait`` seconds (no free server
      connection) or failed: ``unknown``.

    A NOTIFY from ``conn`` itself would prove nothing: in transaction pooling it often
    runs on the very server connection of the LISTEN, and comes back.  Neither would
    comparing ``pg_backend_pid()`` across two transactions (with one server connection
    it never changes) nor a session setting read back (the same).  Costs one round trip
    when direct; behind a pooler one connection and a few milliseconds, at most
    ``notify_wait + hear_wait`` seconds.  The probe's LISTEN is ended with ``UNLISTEN``
    (on whichever server connection that runs, behind transaction pooling).

    Parameters:
      conn(psycopg.Connection): An autocommit connection made by ``_isolation.connect``,
        listening to nothing yet.
      conninfo(str): libpq connection string of the second connection (``conn``'s).
      notify_wait(float): Seconds.  Default :data:`PROBE_NOTIFY_WAIT_S`.
      hear_wait(float): Seconds.  Default :data:`PROBE_HEAR_WAIT_S`.

    Returns:
      ListenProbe: What it found.

    Raises:
      psycopg.Error: If a statement on ``conn`` fails (its connection is then unusable).
    """
    if not behind_pooler(conn):
        return "direct"
    channel = f"dramatiq_pg_outbox_probe_{uuid.uuid4().hex}"
    listen(conn, channel=channel)
    committed = threading.Event()
    echoed = threading.Event()
    sent_at: list[float] = []

    def send() -> None:
        try:
            with connect(
                conninfo, autocommit=True, application_name=f"dramatiq-pg-outbox:{os.getpid()}:probe"
            ) as other:
                other.add_notify_handler(lambda note: echoed.set() if note.channel == channel else None)
                notify_channel(other, channel=channel, payloads=["probe"])
                sent_at.append(time.monotonic())
                committed.set()
        except Exception:
            pass  # unknown, unless committed already

    # A thread: the NOTIFY may wait in the pooler's queue for a server connection.
    threading.Thread(target=send, name="dramatiq-pg-outbox-listen-probe", daemon=True).start()
    start = time.monotonic()
    heard = False
    try:
        while not heard and not echoed.is_set():
            now = time.monotonic()
            if committed.is_set():
                if now >= sent_at[0] + hear_wait:
                    break
            elif now >= start + notify_wait:
                break
            for note in conn.notifies(timeout=0.02, stop_after=1):
                heard = heard or note.channel == channel
    finally:
        unlisten(conn, channel=channel)
    if heard:
        return "session"
    if echoed.is_set() or committed.is_set():
        return "shared"
    return "unknown"


def subscribe(
    conninfo: str,
    channel: str,
    on_notify: Callable[[str], None],
    on_connect: Callable[[], None],
) -> Subscription:
    """Listen to ``channel`` on this process's one LISTEN connection to ``conninfo``.

    Parameters:
      conninfo(str): libpq connection string of the database.
      channel(str): The NOTIFY channel (``names.channel_for`` or ``names.results_channel``).
      on_notify(Callable[[str], None]): Called with each payload, on the listener's thread.
      on_connect(Callable[[], None]): Called once the LISTEN is in force, after each
        (re)connection (notifications sent before it were missed).

    Returns once the LISTEN is in force (``Subscription.connected`` set), or, while the
    listener cannot connect, at once or after at most :data:`SUBSCRIBE_WAIT_S` seconds;
    ``on_connect`` then runs when it is in force.

    Returns:
      Subscription: Close it to stop receiving.
    """
    key = (os.getpid(), conninfo)
    with _registry_lock:
        listener = _listeners.get(key)
        if listener is None or (listener.stopping and not listener.shared):
            listener = _listeners[key] = _Listener(conninfo)
        sub = Subscription(listener, channel, on_notify, on_connect)
        with listener._lock:
            listener.subscriptions.append(sub)
            # Its channel already listened to: in force now, not at the listener's next look.
            ready = channel in listener.listening
            if ready:
                sub.connected.set()
            if ready or listener.shared:
                sub.settled.set()
        if not listener.shared:
            listener.start()
            if not ready:
                listener.nudge()
    if ready:
        on_connect()
    elif listener.failures == 0 and threading.current_thread() is not listener._thread:
        # The listener LISTENs at once (after its probe); while its connection is down it is
        # not waited for, nor once it gave up (a pooler that shares server connections).
        sub.settled.wait(SUBSCRIBE_WAIT_S)
    return sub


def _unsubscribe(sub: Subscription) -> None:
    listener = sub.listener
    with _registry_lock:
        with listener._lock:
            if sub in listener.subscriptions:
                listener.subscriptions.remove(sub)
            last = not listener.subscriptions
        sub.connected.clear()
        if last and _listeners.get((listener.pid, listener.conninfo)) is listener:
            del _listeners[(listener.pid, listener.conninfo)]
    if last:
        listener.stop(timeout=2 * LISTEN_TICK_S + 1)


class KeyedWaiters:
    """Threads of one process blocked on keys, woken by notifications whose payload is the key.

    One subscription to ``channel`` on the process's LISTEN connection; result readers
    (``results``) and barrier waiters (``rate_limits``) use it.  After a (re)connection
    every waiter is woken (it reads again: what was sent meanwhile was not heard).

    Attributes:
      waiting(int): Threads inside :meth:`wait` right now.
    """

    def __init__(self, conninfo: str, channel: str) -> None:
        self.waiting = 0
        self._by_key: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()
        self._subscription = subscribe(conninfo, channel, self.wake, lambda: self.wake(None))

    @property
    def connected(self) -> threading.Event:
        """Set while the channel is listened to."""
        return self._subscription.connected

    def add(self, key: str, wakeup: threading.Event) -> None:
        with self._lock:
            self._by_key.setdefault(key, set()).add(wakeup)

    def remove(self, key: str, wakeup: threading.Event) -> None:
        with self._lock:
            group = self._by_key.get(key)
            if group is not None:
                group.discard(wakeup)
                if not group:
                    del self._by_key[key]

    def wait(self, wakeup: threading.Event, seconds: float) -> None:
        """Block on ``wakeup`` for at most ``seconds``, counted in :attr:`waiting`."""
        with self._lock:
            self.waiting += 1
        try:
            wakeup.wait(seconds)
        finally:
            with self._lock:
                self.waiting -= 1

    def wake(self, key: str | None) -> None:
        """Wake the waiters of ``key``; all of them for ``None`` or an empty key."""
        with self._lock:
            if key:
                targets = list(self._by_key.get(key, ()))
            else:
                targets = [w for group in self._by_key.values() for w in group]
        for wakeup in targets:
            wakeup.set()

    def close(self) -> None:
        self._subscription.close()
