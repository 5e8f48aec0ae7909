"""A real dashboard server for the tests: uvicorn on a free port, in a thread of the test process.

Used by tests/test_dashboard.py (HTTP) and tests/test_dashboard_browser.py (Chromium).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

uvicorn = pytest.importorskip(
    "uvicorn", reason="the dashboard extra is not installed: pip install -e '.[dashboard]'"
)
pytest.importorskip("starlette", reason="the dashboard extra is not installed: pip install -e '.[dashboard]'")

from dramatiq_pg_outbox.dashboard.app import Settings, create_app  # noqa: E402
from dramatiq_pg_outbox.dashboard.store import Store  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


class DashboardServer:
    """``create_app(Settings(...))`` served by uvicorn on 127.0.0.1, port chosen by the kernel."""

    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        config = uvicorn.Config(create_app(settings, store), host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="dashboard", daemon=True)
        self.url = ""

    def start(self) -> DashboardServer:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 30, "the dashboard server", 0.02)
        assert self.server.started, "the dashboard server's thread ended before it listened"
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the dashboard server did not stop"


@pytest.fixture
def serve_dashboard(database_url: str) -> Iterator[Callable[..., DashboardServer]]:
    """Factory: ``serve_dashboard(read_only=..., token=..., basic_auth=..., store=...)`` -> a running server.

    Every server started is stopped when the test ends, pass or fail.
    """
    servers: list[DashboardServer] = []

    def serve(store: Store | None = None, **options: Any) -> DashboardServer:
        options.setdefault("url", database_url)
        server = DashboardServer(Settings(**options), store)
        servers.append(server)
        return server.start()

    try:
        yield serve
    finally:
        for server in servers:
            server.stop()


def csrf_token(html: str) -> str:
    """The CSRF token of the first form on a page."""
    found = _CSRF.search(html)
    assert found, "no form with a CSRF token on this page"
    return found.group(1)
