"""The one shape of every background loop: :class:`Service`.

River's maintenance services are the model (``internal/maintenance``): a config
read once, a ticker, a ``run_once()`` that does one pass and returns what it did
(testable without a thread), a test signal set after each pass, one start/stop,
and one backoff after a failure.  The flusher, the maintenance loop, the LISTEN
fan-out, the results cleaner, the relay and the periodic scheduler are services.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

from dramatiq.common import compute_backoff
from dramatiq.logging import get_logger


class Service:
    """A daemon thread that calls :meth:`run_once` until stopped.

    After a pass that returned, the next one starts :meth:`next_delay` seconds
    later (``interval``, +-``jitter``), earlier on :meth:`wake`.  After a pass
    that raised, it is logged and retried with Dramatiq's exponential backoff
    (``compute_backoff``: ``backoff_first`` doubling up to ``backoff_max``).

    Class attributes (override in a subclass):
      name(str): Thread name suffix and log label.

    Parameters:
      interval(float): Seconds between two passes.
      jitter(float): Fraction of ``interval`` drawn at random either way (0.2: +-20 %),
        so the loops of many processes spread out.  Default 0.
      backoff_first(float): First wait after a failure, in seconds.  Default 0.1.
      backoff_max(float): Longest wait after failures, in seconds.  Default ``interval``.
    """

    name = "service"
    #: Whether the thread pauses before its first pass (the flusher waits for a batch).
    pause_first = False

    def __init__(
        self,
        interval: float,
        *,
        jitter: float = 0.0,
        backoff_first: float = 0.1,
        backoff_max: float | None = None,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.interval = interval
        self.jitter = jitter
        self.backoff_first = backoff_first
        self.backoff_max = interval if backoff_max is None else backoff_max
        #: Set after each pass that returned (a test signal: tests wait on it, never sleep).
        self.ticked = threading.Event()
        #: Consecutive failed passes.
        self.failures = 0
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    #: Errors that end the loop instead of being retried (re-raised by :meth:`run_forever`).
    fatal: tuple[type[Exception], ...] = ()

    # -- what a service defines ----------------------------------------------------------
    def run_once(self) -> Any:
        """One pass; returns what it did (counts).  Raise to be retried with backoff."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Run once in the thread before anything else (before ``pause_first``'s wait); nothing by default."""

    def tick(self) -> Any:
        """One iteration of the loop: :meth:`run_once` unless the service does more per iteration."""
        return self.run_once()

    def next_delay(self) -> float:
        """Seconds until the next pass after one that returned."""
        if not self.jitter:
            return self.interval
        return self.interval * random.uniform(1 - self.jitter, 1 + self.jitter)

    def log_failure(self, error: Exception, delay: float) -> None:
        """Say that a pass failed; the service retries in ``delay`` seconds."""
        self.logger.warning(
            "%s failed (attempt %d), retrying in %.2fs: %s", self.name, self.failures, delay, error
        )

    def pause(self, delay: float) -> None:
        """Wait ``delay`` seconds, or less on :meth:`wake` or :meth:`stop`."""
        self._wake.wait(delay)
        self._wake.clear()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"dramatiq-pg-outbox-{self.name}", daemon=True
                )
                self._thread.start()

    @property
    def started(self) -> bool:
        """Whether :meth:`start` started the thread (it may have ended since)."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """Whether the thread is alive now: started, and not ended (by :meth:`stop` or a fatal error)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def wake(self) -> None:
        """Run the next pass now."""
        if not self._wake.is_set():
            self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current pass; wait up to ``timeout`` seconds for the thread."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)

    def run_forever(self) -> None:
        """Run the loop in the calling thread until :meth:`stop` (a CLI command's main loop)."""
        self._run()

    def _run(self) -> None:
        self.warm_up()
        if self.pause_first:
            self.pause(self.next_delay())
        while not self._stopping.is_set():
            try:
                self.tick()
                self.failures = 0
                delay = self.next_delay()
                self.ticked.set()
            except self.fatal:
                raise
            except Exception as e:
                self.failures += 1
                _, backoff_ms = compute_backoff(
                    self.failures,
                    factor=max(1, int(self.backoff_first * 1000)),
                    max_backoff=max(1, int(self.backoff_max * 1000)),
                )
                delay = backoff_ms / 1000
                self.log_failure(e, delay)
            if self._stopping.is_set():
                return
            self.pause(delay)


class Every(Service):
    """Calls ``task()`` every ``interval`` ms (+-20 %), first after one interval; a failure waits a period.

    The cleanups of expired results and rate-limit keys: safe in many processes at
    once, so the jitter only spreads them.
    """

    pause_first = True

    def __init__(self, name: str, interval: int, task: Callable[[], int]) -> None:
        super().__init__(interval / 1000, jitter=0.2, backoff_first=interval / 1000)
        self.name = name
        self.task = task

    def run_once(self) -> int:
        done = self.task()
        if done:
            self.logger.debug("%s: %d row(s)", self.name, done)
        return done

    def log_failure(self, error: Exception, delay: float) -> None:
        self.logger.warning("%s failed, retrying next interval: %s", self.name, error)
