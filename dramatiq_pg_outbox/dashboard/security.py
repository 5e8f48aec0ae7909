"""Who may use a dashboard and how it is protected: settings, auth, the Host check, CSRF, headers.

See the ``Security`` part of :mod:`~dramatiq_pg_outbox.dashboard.app`'s docstring.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.templating import Jinja2Templates

from ..names import DEFAULT_SCHEMA, validate_schema_name
from ..options import HEARTBEAT_TIMEOUT_MS, check_positive_ints

#: Name of the dashboard's signed session cookie.
SESSION_COOKIE = "dpo_dashboard"
_SECURITY_HEADERS = {
    # Scripts only from files of the dashboard itself (static/live.js: no inline script, no eval),
    # which may fetch only from it.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self'; "
        "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


#: Host names a dashboard answers by default: the loopback names a local browser uses.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclass(frozen=True)
class Settings:
    """How a dashboard is served.

    Parameters:
      url(str): PostgreSQL URL of the broker's database.
      schema(str): Schema of the broker tables.  Default ``dramatiq``.
      read_only(bool): Hide and refuse (403) every action.  Default False.
      token(str|None): Require this token (``Authorization: Bearer`` or the login form).
      basic_auth(tuple[str, str]|None): Require HTTP basic auth with this (user, password).
      session_secret(str|None): Key signing the session cookie; default a random one
        per process (sessions end when the server restarts).  A session logged in with
        the token carries a keyed digest of that token: once the token changes, old
        sessions no longer count as logged in, whatever the secret.
      allowed_hosts(tuple[str, ...]): ``Host`` header values answered (without the port;
        a leading ``*`` matches any prefix, ``*`` alone any host); any other gets 400,
        so a page elsewhere cannot read the dashboard through DNS rebinding.  Default
        :data:`LOOPBACK_HOSTS`; the CLI adds its ``--host`` and ``--allowed-host`` values.
      refresh(int): Seconds between updates of the live pages (queues, a queue, workers,
        schedules): in place with JavaScript, a reload without; 0 for none.  Default 5.
      heartbeat_timeout(int): The workers' ``heartbeat_timeout``, in milliseconds, by which
        the dashboard judges them: one silent for longer counts as dead (its messages are
        not running).  Default :data:`~dramatiq_pg_outbox.options.HEARTBEAT_TIMEOUT_MS`, the
        broker's default; pass the workers' value if they are configured otherwise.
      results_namespace(str): The ``namespace`` of the results backend whose stored result a
        finished message's page shows (Dramatiq's ``ResultBackend``).  Default
        ``dramatiq-results``, Dramatiq's.

    Raises:
      ValueError: If both ``token`` and ``basic_auth`` are given, either is empty,
        ``refresh`` is negative, ``heartbeat_timeout`` is not an integer >= 1, or
        ``schema`` is invalid.
    """

    url: str
    schema: str = DEFAULT_SCHEMA
    read_only: bool = False
    token: str | None = None
    basic_auth: tuple[str, str] | None = None
    session_secret: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    refresh: int = 5
    heartbeat_timeout: int = HEARTBEAT_TIMEOUT_MS
    results_namespace: str = "dramatiq-results"

    def __post_init__(self) -> None:
        if not self.allowed_hosts:
            object.__setattr__(self, "allowed_hosts", LOOPBACK_HOSTS)
        validate_schema_name(self.schema)
        if self.token is not None and self.basic_auth is not None:
            raise ValueError("choose one of token and basic auth, not both")
        if self.token is not None and not self.token:
            raise ValueError("the token is empty")
        if self.basic_auth is not None and not all(self.basic_auth):
            raise ValueError("basic auth needs a non-empty user and password (USER:PASSWORD)")
        if isinstance(self.refresh, bool) or not isinstance(self.refresh, int) or self.refresh < 0:
            raise ValueError(f"refresh must be a whole number of seconds >= 0, not {self.refresh!r}")
        check_positive_ints(heartbeat_timeout=self.heartbeat_timeout)

    @property
    def auth(self) -> str:
        """``token``, ``basic`` or ``none``."""
        return "token" if self.token else "basic" if self.basic_auth else "none"


logger = logging.getLogger("dramatiq_pg_outbox.dashboard")


class LoginThrottle:
    """Failed logins per client: free at first, then an exponential wait.

    After ``free`` failures in a row from one client (its address), each further
    attempt must wait ``base x 2^(failures - free)`` seconds after the last
    failure, at most ``cap``; a success forgets the client.  Every failure is
    logged with the client's address (never the secret).  The idea is
    fail2ban's and django-axes' lockout, without locking anyone out for good.
    State is per process, for at most ``clients`` addresses (the least recently
    failed ones are forgotten first).

    Parameters:
      free(int): Failures allowed before any wait.  Default 5.
      base(float): The first wait, in seconds.  Default 1.
      cap(float): The longest wait, in seconds.  Default 300.
      clients(int): Addresses remembered.  Default 10,000.
      clock(Callable[[], float]): Seconds, monotonic.  Default ``time.monotonic``.
    """

    def __init__(
        self,
        free: int = 5,
        base: float = 1.0,
        cap: float = 300.0,
        clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free, self.base, self.cap, self.clients, self.clock = free, base, cap, clients, clock
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._lock = threading.Lock()

    def wait(self, client: str) -> float:
        """Seconds ``client`` must still wait before its next attempt (0: it may try now)."""
        with self._lock:
            failures, last = self._failures.get(client, (0, 0.0))
        if failures < self.free:
            return 0.0
        delay = min(self.cap, self.base * float(2 ** (failures - self.free)))
        return max(0.0, last + delay - self.clock())

    def failed(self, client: str, what: str) -> None:
        """Count a failed attempt of ``client`` (``what``: e.g. "wrong token"), and log it."""
        with self._lock:
            failures = self._failures.pop(client, (0, 0.0))[0] + 1
            self._failures[client] = (failures, self.clock())
            while len(self._failures) > self.clients:
                self._failures.popitem(last=False)
        logger.warning("dashboard: failed login from %s (%s), %d in a row", client, what, failures)

    def __len__(self) -> int:
        """Addresses remembered now (at most ``clients``)."""
        return len(self._failures)

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures."""
        with self._lock:
            self._failures.pop(client, None)


def client_of(request: Request) -> str:
    """The address a request came from (the proxy's, behind one), for the throttle and the logs."""
    return request.client.host if request.client is not None else "unknown"


def too_many(wait: float) -> PlainTextResponse:
    """429 with ``Retry-After``: the client failed too many logins."""
    seconds = max(1, round(wait))
    return PlainTextResponse(
        f"429 Too Many Requests: too many failed logins from this address; try again in {seconds} s",
        status_code=429,
        headers={"Retry-After": str(seconds)},
    )


# -- auth ---------------------------------------------------------------------
def same_secret(given: str, expected: str) -> bool:
    """Whether two secrets are equal, compared in constant time."""
    return secrets.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def token_mark(token: str) -> str:
    """What a logged-in session stores: a keyed digest of the token it logged in with.

    The session cookie is signed, not encrypted, so the token itself is never put
    in it; a session whose mark is not the current token's (the token was rotated,
    e.g. after a leak) is logged out.
    """
    key = b"dramatiq-pg-outbox dashboard session"
    return hmac.new(key, token.encode("utf-8"), hashlib.sha256).hexdigest()


def _authorized(request: Request, settings: Settings) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, credentials = header.partition(" ")
    if settings.token is not None:
        if scheme.lower() == "bearer" and same_secret(credentials.strip(), settings.token):
            return True
        mark = request.session.get("authenticated")
        return isinstance(mark, str) and same_secret(mark, token_mark(settings.token))
    if settings.basic_auth is not None:
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = (
                base64.b64decode(credentials.strip(), validate=True).decode("utf-8").partition(":")
            )
        except (binascii.Error, UnicodeDecodeError):
            return False
        # Both compared, always, so the time taken does not tell which one was wrong.
        user_ok = same_secret(user, settings.basic_auth[0])
        password_ok = same_secret(password, settings.basic_auth[1])
        return user_ok and password_ok
    return True


class Guard(BaseHTTPMiddleware):
    """401 for requests without the configured credentials; security headers on every response."""

    def __init__(
        self, app: Any, settings: Settings, templates: Jinja2Templates, throttle: LoginThrottle
    ) -> None:
        super().__init__(app)
        self.settings = settings
        self.templates = templates
        self.throttle = throttle

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        path = request.url.path
        public = path in ("/healthz", "/login") or path.startswith("/static/")
        scheme = request.headers.get("authorization", "").partition(" ")[0].lower()
        client = client_of(request)
        wait = self.throttle.wait(client) if scheme in ("bearer", "basic") else 0.0
        if public or (wait == 0 and _authorized(request, self.settings)):
            if scheme in ("bearer", "basic") and not public:
                self.throttle.succeeded(client)
            response = await call_next(request)
        elif wait > 0:
            response = too_many(wait)
        elif self.settings.basic_auth is not None:
            if scheme == "basic":
                self.throttle.failed(client, "wrong basic auth user or password")
            response = PlainTextResponse(
                "401 Unauthorized: this dashboard needs HTTP basic auth",
                status_code=401,
                headers={"WWW-Authenticate": 'Basic realm="dramatiq-pg-outbox", charset="UTF-8"'},
            )
        elif scheme == "bearer":
            # A script's wrong token: a plain answer with the reason, not the login page.
            self.throttle.failed(client, "wrong Bearer token")
            response = PlainTextResponse(
                "401 Unauthorized: the Bearer token is wrong",
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="dramatiq-pg-outbox", error="invalid_token"'},
            )
        else:
            response = self.templates.TemplateResponse(
                request,
                "login.html",
                base_context(request, self.settings, next=path),
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="dramatiq-pg-outbox"'},
            )
        for name, value in _SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


def _csrf_token(request: Request) -> str:
    token = request.session.get("csrf")
    if not isinstance(token, str):
        token = request.session["csrf"] = secrets.token_urlsafe(32)
    return token


async def checked_form(request: Request) -> FormData:
    """The form of a POST, after the CSRF check (403 when the token is missing or wrong)."""
    form = await request.form()
    given = form.get("csrf_token")
    expected = request.session.get("csrf")
    if not isinstance(given, str) or not isinstance(expected, str) or not same_secret(given, expected):
        raise HTTPException(
            403, "The form's CSRF token is missing or out of date: reload the page and try again."
        )
    return form


async def action_form(request: Request) -> FormData:
    """The form of an action: 403 in read-only mode, then the CSRF check."""
    settings: Settings = request.app.state.settings
    if settings.read_only:
        raise HTTPException(403, "This dashboard is read-only (--read-only): actions are disabled.")
    return await checked_form(request)


def flash(request: Request, text: str) -> None:
    """Keep ``text`` in the session for the next page to show once."""
    request.session["flash"] = text


#: Request header of a live page's own updates (static/live.js): the page is fetched again,
#: and the flashed message is left for the next page the operator opens.
LIVE_HEADER = "X-Live"


def base_context(request: Request, settings: Settings, **extra: Any) -> dict[str, Any]:
    """What every template gets (mode, schema, CSRF token, the flashed message), plus ``extra``.

    An update of a live page (header :data:`LIVE_HEADER`) shows no flashed message and
    leaves it in the session: the operator has not seen it yet.
    """
    live = request.headers.get(LIVE_HEADER) == "1"
    return {
        "read_only": settings.read_only,
        "auth": settings.auth,
        "schema": settings.schema,
        "csrf_token": _csrf_token(request),
        "refresh": 0,
        "flash": None if live else request.session.pop("flash", None),
        **extra,
    }
