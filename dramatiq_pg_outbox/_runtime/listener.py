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
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._isolation import connect
from ..store.messages import listen
from .service import Service

if TYPE_CHECKING:
    import psycopg

#: Seconds a listener waits for notifications before it looks at new subscriptions.
LISTEN_TICK_S = 0.5
#: Longest wait after a failed connection, in seconds (the first is 0.2 s).
RECONNECT_MAX_S = LISTEN_TICK_S
#: Longest time :func:`subscribe` waits for its LISTEN while the listener connects, in seconds.
SUBSCRIBE_WAIT_S = 2.0


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
        """Connect, LISTEN, deliver until stopped or disconnected; the notifications delivered."""
        conn = self.connection = connect(
            self.conninfo, autocommit=True, application_name=f"dramatiq-pg-outbox:{os.getpid()}:listen"
        )
        delivered = 0
        try:
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
_registry_lock = threading.Lock()


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
        if listener is None or listener.stopping:
            listener = _listeners[key] = _Listener(conninfo)
        sub = Subscription(listener, channel, on_notify, on_connect)
        with listener._lock:
            listener.subscriptions.append(sub)
            # Its channel already listened to: in force now, not at the listener's next look.
            ready = channel in listener.listening
            if ready:
                sub.connected.set()
        listener.start()
        if not ready:
            listener.nudge()
    if ready:
        on_connect()
    elif listener.failures == 0 and threading.current_thread() is not listener._thread:
        # The listener LISTENs at once; while its connection is down it is not waited for.
        sub.connected.wait(SUBSCRIBE_WAIT_S)
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
