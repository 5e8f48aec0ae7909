"""Helpers of the shop's tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from django.conf import settings

from dramatiq_pg_outbox.django import database_url


def url_of(alias: str) -> str:
    return database_url(settings.DATABASES[alias])


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> None:
    """Poll ``condition`` every 50 ms; fail after ``timeout`` seconds (a bound on a hang, not a measure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
