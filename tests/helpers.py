"""Small helpers shared by the process and chaos tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` every 50 ms; return the seconds it took, or fail after ``timeout`` seconds."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def count(db: Any, query: str, params: Any = None) -> int:
    """The single integer a query returns."""
    return int(db.execute(query, params).fetchone()[0])
