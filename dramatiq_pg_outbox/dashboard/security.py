"""Who may use a dashboard and how it is protected: settings, auth, the Host check, CSRF, headers.

See the ``Security`` part of :mod:`~dramatiq_pg_outbox.dashboard.app`'s docstring.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import re
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

#: The roles of a user: ``read-only`` sees every page and acts on nothing; ``operator`` acts.
ROLES = ("read-only", "operator")
#: How a user logs in: ``token`` (``Authorization: Bearer`` or the login page) or ``basic`` (HTTP basic).
KINDS = ("token", "basic")
_USER_NAME = re.compile(r"[A-Za-z0-9_.@+-]{1,64}")
_SHA256 = re.compile(r"sha256:([0-9a-f]{64})")
_HASH_HINT = "printf %s 'SECRET' | sha256sum"


def secret_digest(secret: str) -> str:
    """The SHA-256 of a secret (UTF-8), in hex: what a users file stores instead of the secret."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class User:
    """One named credential of a dashboard.

    Parameters:
      name(str): Who acts, as the audit trail records it: ``[A-Za-z0-9_.@+-]``, 1-64 characters
        (for ``basic``, the user name typed).
      role(str): ``read-only`` (pages only: no action button, 403 on every action) or ``operator``.
      kind(str): ``token`` (``Authorization: Bearer`` or the login page) or ``basic`` (HTTP basic
        auth, user ``name``).
      digest(str): The SHA-256 of the secret (the token or the password), 64 lowercase hex
        digits (:func:`secret_digest`); the secret itself is never kept.

    Raises:
      ValueError: If a field is not of that form.
    """

    name: str
    role: str
    kind: str
    digest: str

    def __post_init__(self) -> None:
        if not _USER_NAME.fullmatch(self.name):
            raise ValueError(f"bad user name {self.name!r}: 1-64 of letters, digits and _.@+-")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}: choose read-only or operator")
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}: choose token or basic")
        if not re.fullmatch(r"[0-9a-f]{64}", self.digest):
            raise ValueError(f"the secret of {self.name!r} must be sha256:<64 hex digits>: {_HASH_HINT}")

    @property
    def may_act(self) -> bool:
        """Whether this user's role allows actions (``operator``)."""
        return self.role == "operator"


def load_users(path: str) -> tuple[User, ...]:
    """Read a users file: one user a line, ``NAME:ROLE:KIND:sha256:HEX``.

    ``ROLE`` is ``read-only`` or ``operator``; ``KIND`` ``token`` or ``basic``; ``HEX`` the
    SHA-256 of the token or password (``printf %s 'SECRET' | sha256sum``).  Blank lines and
    lines starting with ``#`` are skipped.  Example::

        # name:role:kind:sha256:hex
        alice:operator:token:sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b
        grafana:read-only:basic:sha256:353e1c95995e8036a23498492e8d12a0a5e93852e9546a66ffb03f7c872428f5

    Parameters:
      path(str): The file's path.

    Returns:
      tuple[User, ...]: The users, in the file's order (at least one).

    Raises:
      ValueError: One line naming the file and the line: the file cannot be read, a line is
        not of that form, a role or kind is unknown, a name or a token is given twice, or
        the file names no user.
    """
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"cannot read the users file {path}: {reason}") from None
    users: list[User] = []
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(":", 3)
        if len(fields) != 4:
            raise ValueError(
                f"{path}:{number}: expected NAME:ROLE:KIND:sha256:HEX, got {len(fields)} field(s)"
            )
        name, role, kind, secret = fields
        found = _SHA256.fullmatch(secret)
        if found is None:
            raise ValueError(
                f"{path}:{number}: the secret must be sha256:<64 lowercase hex digits>: {_HASH_HINT}"
            )
        try:
            user = User(name=name, role=role, kind=kind, digest=found.group(1))
        except ValueError as e:
            raise ValueError(f"{path}:{number}: {e}") from None
        if any(u.name == name for u in users):
            raise ValueError(f"{path}:{number}: user {name!r} is named twice")
        if kind == "token" and any(u.kind == "token" and u.digest == user.digest for u in users):
            raise ValueError(f"{path}:{number}: the token of {name!r} is another user's: give each its own")
        users.append(user)
    if not users:
        raise ValueError(f"the users file {path} names no user (NAME:ROLE:KIND:sha256:HEX, one a line)")
    return tuple(users)


@dataclass(frozen=True)
class Settings:
    """How a dashboard is served.

    Parameters:
      url(str): PostgreSQL URL of the broker's database.
      schema(str): Schema of the broker tables.  Default ``dramatiq``.
      read_only(bool): Hide and refuse (403) every action.  Default False.
      token(str|None): Require this token (``Authorization: Bearer`` or the login form).
      basic_auth(tuple[str, str]|None): Require HTTP basic auth with this (user, password).
      users(tuple[User, ...]): Named credentials, each with a role (:func:`load_users` reads
        them from a file); the token and the basic auth above are one ``operator`` each,
        named ``token`` and the basic-auth user.  Default none.
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
      read_url(str|None): PostgreSQL URL of a hot standby of ``url``'s server: the pages read
        there and show how far behind the primary it is; every action writes on ``url``.
        Default None: everything on ``url``.

    Raises:
      ValueError: If more than one of ``token``, ``basic_auth`` and ``users`` is given, one is
        empty, two users share a name, ``refresh`` is negative, ``heartbeat_timeout`` is not
        an integer >= 1, or
        ``schema`` is invalid.
    """

    url: str
    schema: str = DEFAULT_SCHEMA
    read_only: bool = False
    token: str | None = None
    basic_auth: tuple[str, str] | None = None
    users: tuple[User, ...] = ()
    session_secret: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    refresh: int = 5
    heartbeat_timeout: int = HEARTBEAT_TIMEOUT_MS
    results_namespace: str = "dramatiq-results"
    read_url: str | None = None

    def __post_init__(self) -> None:
        if not self.allowed_hosts:
            object.__setattr__(self, "allowed_hosts", LOOPBACK_HOSTS)
        validate_schema_name(self.schema)
        given = [self.token is not None, self.basic_auth is not None, bool(self.users)]
        if sum(given) > 1:
            raise ValueError("choose one of token, basic auth and users, not several")
        names = [user.name for user in self.users]
        if len(set(names)) != len(names):
            raise ValueError("two users have the same name: give each its own")
        if self.token is not None and not self.token:
            raise ValueError("the token is empty")
        if self.basic_auth is not None and not all(self.basic_auth):
            raise ValueError("basic auth needs a non-empty user and password (USER:PASSWORD)")
        if isinstance(self.refresh, bool) or not isinstance(self.refresh, int) or self.refresh < 0:
            raise ValueError(f"refresh must be a whole number of seconds >= 0, not {self.refresh!r}")
        check_positive_ints(heartbeat_timeout=self.heartbeat_timeout)

    @property
    def accounts(self) -> tuple[User, ...]:
        """Who may log in: ``users``, or the token (an operator named ``token``), or the basic-auth user."""
        if self.token:
            return (User("token", "operator", "token", secret_digest(self.token)),)
        if self.basic_auth:
            user, password = self.basic_auth
            return (User(user, "operator", "basic", secret_digest(password)),)
        return self.users

    @property
    def auth(self) -> str:
        """``token`` (some user logs in with a token), ``basic`` (all with basic auth) or ``none``."""
        kinds = {user.kind for user in self.accounts}
        return "token" if "token" in kinds else "basic" if kinds else "none"


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
    return user_mark(secret_digest(token))


def user_mark(digest: str) -> str:
    """The session mark of a user whose secret has SHA-256 ``digest`` (see :func:`token_mark`)."""
    key = b"dramatiq-pg-outbox dashboard session"
    return hmac.new(key, digest.encode("ascii"), hashlib.sha256).hexdigest()


def token_user(settings: Settings, token: str) -> User | None:
    """The token user whose token is ``token``, or None (every user compared, in constant time)."""
    digest = secret_digest(token)
    found = None
    for user in settings.accounts:
        if same_secret(digest, user.digest) and user.kind == "token":
            found = user
    return found


def _basic_user(settings: Settings, credentials: str) -> User | None:
    try:
        name, _, password = (
            base64.b64decode(credentials.strip(), validate=True).decode("utf-8").partition(":")
        )
    except (binascii.Error, UnicodeDecodeError):
        return None
    digest = secret_digest(password)
    found = None
    for user in settings.accounts:
        # Name and password compared, always, so the time taken does not tell which one was wrong.
        name_ok = same_secret(name, user.name)
        password_ok = same_secret(digest, user.digest)
        if name_ok and password_ok and user.kind == "basic":
            found = user
    return found


def _authenticated(request: Request, settings: Settings) -> User | None:
    """The user a request comes from (its Bearer token, basic auth or session), or None."""
    header = request.headers.get("authorization", "")
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() == "bearer":
        return token_user(settings, credentials.strip())
    if scheme.lower() == "basic":
        return _basic_user(settings, credentials)
    name, mark = request.session.get("user"), request.session.get("authenticated")
    for user in settings.accounts:
        if user.kind == "token" and user.name == name and isinstance(mark, str):
            return user if same_secret(mark, user_mark(user.digest)) else None
    return None


def current_user(request: Request) -> User | None:
    """The user the request was let in as (None: the dashboard has no auth)."""
    user = getattr(request.state, "user", None)
    return user if isinstance(user, User) else None


def may_act(request: Request) -> bool:
    """Whether the request may act: the dashboard is not ``read_only`` and its user is an operator."""
    settings: Settings = request.app.state.settings
    user = current_user(request)
    return not settings.read_only and (user is None or user.may_act)


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
        user = (
            None
            if public or wait > 0 or not self.settings.accounts
            else _authenticated(request, self.settings)
        )
        request.state.user = user
        if public or (wait == 0 and (user is not None or not self.settings.accounts)):
            if scheme in ("bearer", "basic") and not public:
                self.throttle.succeeded(client)
            response = await call_next(request)
        elif wait > 0:
            response = too_many(wait)
        elif self.settings.auth == "basic":
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
    user = current_user(request)
    if user is not None and not user.may_act:
        raise HTTPException(
            403, f"User {user.name} is read-only (its role in the users file): actions are disabled."
        )
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
        "read_only": settings.read_only or not may_act(request),
        "auth": settings.auth,
        "user": user.name if (user := current_user(request)) is not None else None,
        "schema": settings.schema,
        "csrf_token": _csrf_token(request),
        "refresh": 0,
        "read_lag": None,
        "flash": None if live else request.session.pop("flash", None),
        **extra,
    }
