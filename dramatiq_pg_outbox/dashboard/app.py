"""The dashboard's web application: Starlette routes rendering Jinja2 templates.

Pages (GET): ``/`` queues, ``/queues/{queue}`` a queue's live messages
(filters: status, actor; pages of 100; running told from prefetched),
``/messages/{id}`` one message, live or finished, with every delivery of it
(``/messages/find?message_id=`` the newest row of a Dramatiq message id),
``/history`` finished messages (filters: time range, queue, actor, state,
message id, arguments; keyset pages of 50), ``/workers``, ``/schedules`` periodic
jobs, ``/failed`` dead letters (filters: queue, actor, error type, text),
``/failed/{id}`` one dead letter, ``/charts`` throughput and latency per
actor, ``/healthz`` (no auth; "ok" when the database answers).  The queues,
queue, workers and schedules pages update themselves every
``Settings.refresh`` seconds: ``static/live.js`` fetches the page again
(header ``X-Live: 1``) and brings its ``[data-live]`` regions up to date in
place, keeping what the operator ticked, selected and scrolled to; without
JavaScript a ``<noscript>`` ``<meta http-equiv="refresh">`` reloads the page
instead.  ``?refresh=off`` stops both.

Actions (POST, refused with 403 in read-only mode or without the CSRF token
of the session): ``/failed/retry``, ``/failed/discard``, ``/queues/{queue}/purge``,
``/queues/{queue}/pause``, ``/queues/{queue}/resume``, ``/messages/{id}/cancel``,
``/messages/{id}/run-now``, ``/schedules/toggle``, ``/schedules/run-now``.

Security:

- Every value from the database reaches the page through Jinja2 with
  autoescaping on (HTML and the inline SVG alike); a Content-Security-Policy
  is sent as a second line of defence: scripts only from the dashboard's own
  files (``script-src 'self'``, no inline script, no eval), fetches only to it.
- CSRF: a random token is kept in the session (Starlette's signed session
  cookie, ``SameSite=lax``, ``HttpOnly``) and every form carries it; a POST
  whose token is missing or different gets 403 (the synchronizer-token
  pattern of the OWASP CSRF cheat sheet).
- Auth, when configured: a token (``Authorization: Bearer <token>``, or typed
  once into ``/login``, which marks the session with a keyed digest of that
  token, so rotating the token ends every older session) or HTTP basic;
  anything else gets 401.  Secrets are compared in constant time.
- Host names: only requests whose ``Host`` is in ``Settings.allowed_hosts``
  are answered (Starlette's ``TrustedHostMiddleware``; 400 otherwise), so a
  page on another site cannot reach a dashboard without auth through DNS
  rebinding (its requests carry the attacker's host name).
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any
from urllib.parse import urlencode

import jinja2
import psycopg
import psycopg_pool
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from ..formats import error_parts, format_age, format_time
from ..names import validate_queue_name
from ..store.admin import limit_target
from ..urls import mask_password
from . import charts
from .security import (
    LOOPBACK_HOSTS,
    SESSION_COOKIE,
    Guard,
    LoginThrottle,
    Settings,
    action_form,
    base_context,
    checked_form,
    client_of,
    current_user,
    flash,
    token_user,
    too_many,
    user_mark,
)
from .store import (
    HISTORY_PAGE,
    MIN_SCHEMA_REVISION,
    FailedFilter,
    HistoryFilter,
    HistoryRow,
    Store,
    decode_payload,
    follow_ups,
    message_timestamp,
    parse_time,
)

logger = logging.getLogger(__name__)

#: Rows of the Audit page (the newest actions).
AUDIT_ROWS = 200
#: Dead letters per page of ``/failed``; live messages per page of a queue.
PAGE_SIZE = 50
#: Concurrency keys listed on the Limits page, the most waiting first.
KEYS_SHOWN = 50
QUEUE_MESSAGES = 100
#: The queue page's status filter: what a live row waits for.
QUEUE_STATUSES = ("due", "delayed", "processing")

#: Chart windows: name -> (window, bucket of message_stats(), bucket label).  50-60 buckets each.
WINDOWS: dict[str, tuple[dt.timedelta, dt.timedelta, str]] = {
    "15m": (dt.timedelta(minutes=15), dt.timedelta(seconds=15), "15 s"),
    "1h": (dt.timedelta(hours=1), dt.timedelta(minutes=1), "1 min"),
    "6h": (dt.timedelta(hours=6), dt.timedelta(minutes=5), "5 min"),
    "24h": (dt.timedelta(hours=24), dt.timedelta(minutes=30), "30 min"),
    "7d": (dt.timedelta(days=7), dt.timedelta(hours=3), "3 h"),
}
#: Actors drawn in the per-actor charts (most deliveries first).
MAX_ACTORS = 8

_QUEUE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")


def broker_channel(url: str, schema: str) -> str:
    """The NOTIFY channel of the broker tables in ``schema`` (a retry wakes their workers).

    Named by ``PostgresBroker`` itself, so the two can never disagree; the broker
    is only constructed (it connects lazily, and is not used).
    """
    from ..broker import PostgresBroker

    return PostgresBroker(url=url, schema=schema).channel


# -- formatting ---------------------------------------------------------------
def merge_query(params: Any, **changes: str | None) -> str:
    """The query string of ``params`` (a request's query parameters) with ``changes``; None drops one."""
    merged = [(k, v) for k, v in params.multi_items() if k not in changes]
    merged += [(k, v) for k, v in changes.items() if v is not None]
    return urlencode(merged)


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__ or "dramatiq_pg_outbox.dashboard", "templates"),
        # Every template, whatever its name, escapes what it prints.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["age"] = format_age
    env.filters["time"] = format_time
    env.filters["number"] = lambda n: f"{int(n):,}"
    env.filters["merge"] = merge_query
    env.globals["error_parts"] = error_parts
    return Jinja2Templates(env=env)


# -- pages --------------------------------------------------------------------
def _optional(value: Any) -> str | None:
    return value.strip() or None if isinstance(value, str) else None


def _failed_filter(values: Any) -> FailedFilter:
    return FailedFilter(
        queue_name=_optional(values.get("queue")),
        actor_name=_optional(values.get("actor")),
        error_type=_optional(values.get("error_type")),
        search=_optional(values.get("q")),
    )


def _failed_query(where: FailedFilter, page: int = 1) -> str:
    params = {
        "queue": where.queue_name,
        "actor": where.actor_name,
        "error_type": where.error_type,
        "q": where.search,
        "page": page if page > 1 else None,
    }
    return urlencode({k: v for k, v in params.items() if v})


#: The history page's quick time ranges: label -> how far back.
HISTORY_RANGES: dict[str, dt.timedelta] = {
    "1 h": dt.timedelta(hours=1),
    "24 h": dt.timedelta(days=1),
    "7 d": dt.timedelta(days=7),
    "30 d": dt.timedelta(days=30),
}
#: How far back the history page looks when no ``since`` is given.
HISTORY_DEFAULT_RANGE = dt.timedelta(days=1)
HISTORY_STATES = ("completed", "failed", "canceled")


def _epoch_ms(value: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromtimestamp(int(value) / 1000, dt.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _history_filter(params: Any, now: dt.datetime) -> tuple[str | None, HistoryFilter]:
    """The history page's filter from its query parameters, and a problem to show (None: none)."""
    problem = None
    since, until = now - HISTORY_DEFAULT_RANGE, None
    try:
        if _optional(params.get("since")):
            since = parse_time(params["since"], now)
        if _optional(params.get("until")):
            until = parse_time(params["until"], now)
    except ValueError as exc:
        problem = str(exc)
    state = _optional(params.get("state"))
    if state not in (None, *HISTORY_STATES):
        problem, state = f"No state {state!r}: completed or failed.", None
    before = None
    cursor = _optional(params.get("before"))
    if cursor:
        at, _, row_id = cursor.rpartition("_")
        try:
            before = (dt.datetime.fromisoformat(at), int(row_id))
        except ValueError:
            problem = f"Not a page cursor: {cursor!r}."
    where = HistoryFilter(
        since=since, until=until, queue_name=_optional(params.get("queue")),
        actor_name=_optional(params.get("actor")), state=state,
        message_id=_optional(params.get("message_id")), args=_optional(params.get("args")), before=before,
    )  # fmt: skip
    return problem, where


def _ids(form: Any) -> list[int]:
    """The ticked dead letter ids of a form (400 if one is not an integer)."""
    try:
        return sorted({int(v) for v in form.getlist("ids") if isinstance(v, str)})
    except ValueError:
        raise HTTPException(400, "Dead letter ids must be integers.") from None


def _page_number(params: Any) -> int:
    try:
        return max(1, int(params.get("page", "1")))
    except ValueError:
        return 1


def _query(**params: Any) -> str:
    """A query string of the non-empty ``params`` (page 1 is the default, left out)."""
    return urlencode({k: v for k, v in params.items() if v and not (k == "page" and v == 1)})


def _queue_name(request: Request) -> str:
    name = str(request.path_params["queue_name"])
    if not _QUEUE_NAME.fullmatch(name):
        raise HTTPException(404, "No such queue.")
    return name


class Dashboard:
    """The routes, bound to one :class:`Settings` and one :class:`Store`."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.templates = _templates()
        #: Failed logins per client address (the login form, Bearer tokens, basic auth).
        self.throttle = LoginThrottle()

    def render(self, request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        return self.templates.TemplateResponse(
            request, name, base_context(request, self.settings, **context), status_code=status_code
        )

    async def page(self, request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        """:meth:`render` a page of what the database holds, with the read server's lag above it.

        With a ``read_url``, every such page says where its rows come from and how far
        behind the primary that standby is (``Store.read_lag``), inside the live region, so
        an auto-refreshed page keeps it current.
        """
        return self.render(request, name, status_code, read_lag=await self.store.read_lag(), **context)

    async def healthz(self, request: Request) -> Response:
        await self.store.ping()
        return PlainTextResponse("ok")

    async def queues(self, request: Request) -> Response:
        queues = await self.store.queues()
        now = await self.store.now()
        minutes: dict[str, dict[dt.datetime, int]] = {}
        for row in await self.store.queue_minutes():
            minutes.setdefault(row.queue_name, {})[row.minute] = row.n
        sparks = {q.queue_name: charts.sparkline(minutes.get(q.queue_name, {}), now) for q in queues}
        paused = await self.store.paused_queues()
        return await self.page(
            request, "queues.html", page="queues", queues=queues, sparks=sparks, now=now, paused=paused,
            refresh=self.refresh(request),
        )  # fmt: skip

    async def queue(self, request: Request) -> Response:
        name = _queue_name(request)
        params = request.query_params
        status = params.get("status") if params.get("status") in QUEUE_STATUSES else None
        actor = _optional(params.get("actor"))
        page = _page_number(params)
        rows = await self.store.queue_messages(
            name, QUEUE_MESSAGES + 1, (page - 1) * QUEUE_MESSAGES, actor_name=actor, status=status
        )
        summary = next((q for q in await self.store.queues() if q.queue_name == name), None)
        paused = await self.store.paused_queues()
        by_worker = await self.store.running()
        running = None if by_worker is None else {i for ids in by_worker.values() for i in ids}
        filters = {"status": status, "actor": actor}
        return await self.page(
            request, "queue.html", page="queues", queue_name=name, messages=rows[:QUEUE_MESSAGES],
            summary=summary, limit=QUEUE_MESSAGES, paused_at=paused.get(name), running=running,
            statuses=QUEUE_STATUSES, status=status, actor=actor, actors=await self.store.queue_actors(name),
            page_number=page, first=(page - 1) * QUEUE_MESSAGES + 1,
            prev_query=_query(**filters, page=page - 1) if page > 1 else None,
            next_query=_query(**filters, page=page + 1) if len(rows) > QUEUE_MESSAGES else None,
            refresh=self.refresh(request),
        )  # fmt: skip

    def refresh(self, request: Request) -> int:
        """Seconds between updates of a live page (``static/live.js``, or a reload without it); 0: none.

        ``Settings.refresh`` (default 5), unless the page was opened with
        ``?refresh=off`` (its link "pause auto-refresh").
        """
        return 0 if request.query_params.get("refresh") == "off" else self.settings.refresh

    async def message(self, request: Request) -> Response:
        """One message, live (``messages``) or finished (``history``), with every delivery of it."""
        row_id = int(request.path_params["id"])
        message = await self.store.message(row_id)
        if message is None:
            return await self._finished(request, row_id, page="history")
        is_json, payload = decode_payload(message.payload or b"", message.payload_bytes)
        since = message_timestamp(message.payload, message.payload_tail)
        whole = message.payload or b""
        return await self.page(
            request, "message.html", page="queues", message=message, payload=payload, is_json=is_json,
            deliveries=await self.store.deliveries(message.message_id, since), since=since,
            follow_ups=follow_ups(whole) if message.payload_bytes == len(whole) else {},
        )  # fmt: skip

    async def _finished(self, request: Request, row_id: int, page: str, state: str | None = None) -> Response:
        """The page of a finished row: its deliveries, errors, result and follow-ups, linked."""
        letter = await self.store.finished_message(row_id)
        if letter is None or (state is not None and letter.state != state):
            what = "dead letter" if state == "failed" else "message"
            raise HTTPException(
                404, f"No {what} {row_id}: not in the messages table nor in history (pruned, or discarded?)."
            )
        is_json, payload = decode_payload(letter.payload, letter.payload_bytes)
        since = message_timestamp(letter.payload, letter.payload_tail)
        complete = letter.payload_bytes == len(letter.payload)
        result = await self.store.message_result(
            letter.queue_name, letter.actor_name, letter.message_id, self.settings.results_namespace
        )
        return await self.page(
            request, "finished.html", page=page, letter=letter, payload=payload, is_json=is_json,
            deliveries=await self.store.deliveries(letter.message_id, since), since=since,
            follow_ups=follow_ups(letter.payload) if complete else {},
            result=decode_payload(result)[1] if result is not None else None,
        )  # fmt: skip

    async def find_message(self, request: Request) -> Response:
        """``/messages/find?message_id=...&since=<epoch ms>``: the newest row of a Dramatiq message id."""
        message_id = _optional(request.query_params.get("message_id"))
        if message_id is None:
            raise HTTPException(400, "Give a message id: /messages/find?message_id=<id>.")
        since = _epoch_ms(request.query_params.get("since"))
        row_id = await self.store.find_message(message_id, since)
        if row_id is None:
            raise HTTPException(
                404, f"No row of message {message_id}: not enqueued yet, or finished and pruned."
            )
        return RedirectResponse(request.url_for("message", id=row_id), status_code=303)

    async def message_payload(self, request: Request) -> Response:
        """The raw payload of a message, live or finished, as a download (its page shows 64 KiB)."""
        row_id = int(request.path_params["id"])
        payload = await self.store.message_payload(row_id)
        if payload is None:
            payload = await self.store.finished_payload(row_id)
        if payload is None:
            raise HTTPException(
                404, f"No message {row_id}: not in the messages table nor in history (pruned, or discarded?)."
            )
        return Response(
            payload,
            media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="message-{row_id}.payload"'},
        )

    async def workers(self, request: Request) -> Response:
        return await self.page(
            request, "workers.html", page="workers", workers=await self.store.workers(),
            running=await self.store.running(), refresh=self.refresh(request),
            heartbeat_timeout_s=self.store.heartbeat_timeout / 1000,
        )  # fmt: skip

    async def schedules(self, request: Request) -> Response:
        return await self.page(
            request, "schedules.html", page="schedules", schedules=await self.store.schedules(),
            refresh=self.refresh(request),
        )  # fmt: skip

    async def limits(self, request: Request) -> Response:
        """The run-time limits of concurrency keys and the busiest keys (docs/guides/concurrency.md)."""
        prefix = request.query_params.get("prefix") or None
        queue = request.query_params.get("queue") or None
        return await self.page(
            request, "limits.html", page="limits", limits=await self.store.limits(),
            keys=await self.store.busiest_keys(prefix, KEYS_SHOWN, queue), prefix=prefix or "",
            queue=queue or "", keys_shown=KEYS_SHOWN, refresh=self.refresh(request),
        )  # fmt: skip

    async def set_limit(self, request: Request) -> Response:
        """Set (``max_running`` given) or remove (empty) the run-time limit of a key prefix, in
        one queue (``queue`` given) or in every queue."""
        form = await action_form(request)
        prefix = form.get("prefix")
        if not isinstance(prefix, str) or not prefix.strip() or len(prefix) > 200:
            raise HTTPException(400, "Which keys? Give a key prefix of 1 to 200 characters, e.g. customer:")
        raw_queue = form.get("queue")
        queue = raw_queue.strip() if isinstance(raw_queue, str) and raw_queue.strip() else None
        if queue is not None:
            try:
                validate_queue_name(queue)
            except ValueError as e:
                raise HTTPException(400, str(e)) from None
        where = f"keys {prefix}*" + (f" of queue {queue}" if queue else "")
        target = limit_target(prefix, queue)
        raw = form.get("max_running")
        text = raw.strip() if isinstance(raw, str) else ""
        if not text:
            removed = await self.store.unset_limit(prefix, queue)
            await self.record(request, "limit-unset", target, removed or 0)
            flash(
                request,
                f"Removed the limit {removed} of {where}: they take another limit or the ones their "
                "messages carry."
                if removed is not None
                else f"There was no run-time limit for {where}.",
            )
            return RedirectResponse(request.url_for("limits"), status_code=303)
        if not text.isdigit():
            raise HTTPException(400, f"The limit is a whole number of messages, 0 or more, not {text!r}.")
        previous = await self.store.set_limit(prefix, int(text), queue)
        await self.record(
            request, "limit-set", target, int(text), f"previous: {'none' if previous is None else previous}"
        )
        flash(
            request,
            f"{where[0].upper()}{where[1:]} may now have {int(text)} message(s) processing at a time "
            f"(was: {'none' if previous is None else previous}); the workers were woken.",
        )
        return RedirectResponse(request.url_for("limits"), status_code=303)

    async def failed(self, request: Request) -> Response:
        where = _failed_filter(request.query_params)
        page = _page_number(request.query_params)
        rows = await self.store.failed(where, PAGE_SIZE, (page - 1) * PAGE_SIZE)
        total = rows[0].total if rows else 0
        errors = await self.store.error_types()
        return await self.page(
            request,
            "failed.html",
            page="failed",
            rows=rows,
            total=total,
            where=where,
            page_number=page,
            pages=max(1, -(-total // PAGE_SIZE)),
            queues=await self.store.failed_queues(),
            actors=sorted({e.actor_name for e in errors if e.failed}),
            error_types=sorted({e.error_type for e in errors if e.failed}),
            query=_failed_query(where),
            prev_query=_failed_query(where, page - 1),
            next_query=_failed_query(where, page + 1),
        )

    async def dead_letter(self, request: Request) -> Response:
        """``/failed/{id}``: the finished message's page, for a dead letter only."""
        return await self._finished(request, int(request.path_params["id"]), page="failed", state="failed")

    async def history(self, request: Request) -> Response:
        """Finished messages, newest first, filtered (see :class:`HistoryFilter`); keyset pages."""
        params = request.query_params
        now = await self.store.now()
        problem, where = _history_filter(params, now)
        rows: list[HistoryRow] = []
        if problem is None:
            try:
                rows = await self.store.history(where, HISTORY_PAGE + 1)
            except psycopg.errors.QueryCanceled:
                problem = (
                    f"The search ran longer than {self.store.search_timeout_ms / 1000:g} s: narrow the time "
                    "range, or name the actor or the queue."
                )
        more = len(rows) > HISTORY_PAGE
        rows = rows[:HISTORY_PAGE]
        return await self.page(
            request, "history.html", page="history", rows=rows, where=where, problem=problem,
            next_query=merge_query(params, before=rows[-1].cursor) if more and rows else None,
            first_query=merge_query(params, before=None) if where.before else None,
            ranges=HISTORY_RANGES, now=now,
        )  # fmt: skip

    async def charts(self, request: Request) -> Response:
        window_name = request.query_params.get("window", "1h")
        if window_name not in WINDOWS:
            window_name = "1h"
        window, bucket, bucket_label = WINDOWS[window_name]
        now = await self.store.now()
        stats = await self.store.message_stats(bucket, now - window)
        return await self.page(
            request,
            "charts.html",
            page="charts",
            window_name=window_name,
            windows=list(WINDOWS),
            bucket=bucket_label,
            charts=charts.actor_charts(stats, now - window, now, bucket, bucket_label, MAX_ACTORS),
            top_errors=[e for e in await self.store.error_types() if e.rank <= 5],
            attempts=await self.store.message_attempts(),
        )

    # -- actions ----------------------------------------------------------------
    async def audit(self, request: Request) -> Response:
        """The audit trail: the newest operator actions, from here and from the command line."""
        entries = await self.store.audit(AUDIT_ROWS)
        return await self.page(request, "audit.html", page="audit", entries=entries)

    async def record(self, request: Request, action: str, target: str, count: int, detail: str = "") -> None:
        """The audit row of an action, logged too.

        Who acted: the name of the user (of the users file; the basic-auth user; ``token``
        for the single ``--token``), or ``anonymous`` on a dashboard without auth.
        """
        user = current_user(request)
        operator = user.name if user is not None else "anonymous"
        where = f"from {client_of(request)}" + (f"; {detail}" if detail else "")
        kept = await self.store.record_audit(
            operator=operator, source="dashboard", action=action, target=target, count=count, detail=where
        )
        logger.info("dashboard: %s by %s %s: %s, %d row(s)", action, operator, where, target, count)
        if not kept:
            logger.warning("dashboard: no audit table (migration 0017): run dramatiq-pg-outbox migrate")

    async def retry(self, request: Request) -> Response:
        form = await action_form(request)
        where = _failed_filter(form)
        if form.get("all") == "1":
            moved = await self.store.retry_failed(None, where)
        else:
            ids = _ids(form)
            if not ids:
                flash(request, "Nothing selected: tick the dead letters to retry.")
                return RedirectResponse(
                    f"{request.url_for('failed')}?{_failed_query(where)}", status_code=303
                )
            moved = await self.store.retry_failed(ids, FailedFilter())
        count = sum(moved.values())
        per_queue = ", ".join(f"{n} on {q}" for q, n in moved.items())
        flash(request, f"Re-enqueued {count} dead letter(s)" + (f": {per_queue}." if per_queue else "."))
        await self.record(request, "retry", _selection(form, where), count)
        return RedirectResponse(f"{request.url_for('failed')}?{_failed_query(where)}", status_code=303)

    async def discard(self, request: Request) -> Response:
        form = await action_form(request)
        where = _failed_filter(form)
        back = RedirectResponse(f"{request.url_for('failed')}?{_failed_query(where)}", status_code=303)
        if form.get("confirm") != "yes":
            flash(request, "Not discarded: tick the box to confirm (discarding deletes for good).")
            return back
        if form.get("all") == "1":
            gone = await self.store.discard_failed(None, where)
        else:
            ids = _ids(form)
            if not ids:
                flash(request, "Nothing selected: tick the dead letters to discard.")
                return back
            gone = await self.store.discard_failed(ids, FailedFilter())
        count = sum(gone.values())
        flash(request, f"Discarded {count} dead letter(s) for good.")
        await self.record(request, "discard", _selection(form, where), count)
        return back

    async def run_now(self, request: Request) -> Response:
        row_id = int(request.path_params["id"])
        await action_form(request)
        queue_name = await self.store.run_now(row_id)
        await self.record(request, "run-now", str(row_id), int(queue_name is not None))
        if queue_name is None:
            flash(request, f"Message {row_id} was not delayed any more (due, running or gone): unchanged.")
            return RedirectResponse(request.url_for("queues"), status_code=303)
        flash(request, f"Message {row_id} is due now: its workers were woken.")
        return RedirectResponse(request.url_for("queue", queue_name=queue_name), status_code=303)

    async def toggle_schedule(self, request: Request) -> Response:
        form = await action_form(request)
        name, enabled = form.get("name"), form.get("enabled") == "1"
        if not isinstance(name, str) or not name:
            raise HTTPException(400, "Which schedule? The form names none.")
        changed = await self.store.set_schedule_enabled(name, enabled)
        await self.record(request, "schedule-enable" if enabled else "schedule-disable", name, int(changed))
        if changed:
            done = "Enabled" if enabled else "Disabled"
            flash(request, f"{done} schedule {name}." + ("" if enabled else " Schedulers skip its ticks."))
        else:
            flash(
                request,
                f"Schedule {name} was already {'enabled' if enabled else 'disabled'} (or is removed).",
            )
        return RedirectResponse(request.url_for("schedules"), status_code=303)

    async def run_schedule_now(self, request: Request) -> Response:
        """A schedule's next tick due now: the schedulers enqueue it at their next pass."""
        form = await action_form(request)
        name = form.get("name")
        if not isinstance(name, str) or not name:
            raise HTTPException(400, "Which schedule? The form names none.")
        changed = await self.store.run_schedule_now(name)
        await self.record(request, "schedule-run-now", name, int(changed))
        flash(
            request,
            f"Schedule {name} is due now: a running scheduler enqueues it within its poll interval."
            if changed
            else f"Schedule {name} was not changed: disabled, removed, or due already.",
        )
        return RedirectResponse(request.url_for("schedules"), status_code=303)

    async def purge(self, request: Request) -> Response:
        name = _queue_name(request)
        form = await action_form(request)
        if form.get("confirm") != "yes":
            flash(request, "Not purged: tick the box to confirm.")
            return RedirectResponse(request.url_for("queue", queue_name=name), status_code=303)
        n = await self.store.purge_queue(name)
        flash(request, f"Purged {n} waiting message(s) from queue {name}.")
        await self.record(request, "purge", name, n)
        return RedirectResponse(request.url_for("queue", queue_name=name), status_code=303)

    async def pause(self, request: Request) -> Response:
        name = _queue_name(request)
        await action_form(request)
        changed = await self.store.pause_queue(name)
        await self.record(request, "pause", name, int(changed))
        if changed:
            flash(request, f"Paused queue {name}: workers stop claiming it; messages keep arriving and wait.")
        else:
            flash(request, f"Queue {name} was already paused.")
        return RedirectResponse(request.url_for("queue", queue_name=name), status_code=303)

    async def resume(self, request: Request) -> Response:
        name = _queue_name(request)
        await action_form(request)
        changed = await self.store.resume_queue(name)
        await self.record(request, "resume", name, int(changed))
        if changed:
            flash(request, f"Resumed queue {name}: its workers were woken.")
        else:
            flash(request, f"Queue {name} was not paused.")
        return RedirectResponse(request.url_for("queue", queue_name=name), status_code=303)

    async def cancel(self, request: Request) -> Response:
        row_id = int(request.path_params["id"])
        await action_form(request)
        reason = f"canceled from the dashboard at {format_time(dt.datetime.now(dt.timezone.utc))}"
        result = await self.store.cancel_message(row_id, reason)
        await self.record(request, "cancel", str(row_id), int(result.outcome is not None))
        if result.queue_name is None:
            if result.finished_state is not None and result.finished_at is not None:
                flash(
                    request,
                    f"Message {row_id} already finished ({result.finished_state}) at "
                    f"{format_time(result.finished_at)}: not canceled.",
                )
                return RedirectResponse(request.url_for("message", id=row_id), status_code=303)
            flash(request, f"There is no message {row_id} (never stored, or pruned): not canceled.")
            return RedirectResponse(request.url_for("queues"), status_code=303)
        if result.outcome == "canceling":
            flash(
                request,
                f"Canceling message {row_id}: its worker ({result.worker or 'gone'}) stops its actor; "
                "it ends in history as canceled, with no retry and no follow-ups.",
            )
        else:
            flash(request, f"Canceled message {row_id}: it is in history as canceled.")
        return RedirectResponse(request.url_for("queue", queue_name=result.queue_name), status_code=303)

    # -- login --------------------------------------------------------------------
    async def login_page(self, request: Request) -> Response:
        if self.settings.auth != "token":
            return RedirectResponse(request.url_for("queues"), status_code=303)
        return self.render(request, "login.html", next=_safe_next(request.query_params.get("next")))

    async def login(self, request: Request) -> Response:
        form = await checked_form(request)
        token = form.get("token")
        target = _safe_next(form.get("next"))
        if self.settings.auth != "token":
            return RedirectResponse(target, status_code=303)
        client = client_of(request)
        wait = self.throttle.wait(client)
        if wait > 0:
            return too_many(wait)
        user = token_user(self.settings, token) if isinstance(token, str) else None
        if user is not None:
            self.throttle.succeeded(client)
            # A fresh CSRF token with the new privilege (no fixation of the old one).
            request.session.clear()
            request.session["user"] = user.name
            request.session["authenticated"] = user_mark(user.digest)
            return RedirectResponse(target, status_code=303)
        self.throttle.failed(client, "wrong token in the login form")
        return self.render(request, "login.html", status_code=401, next=target, error="Wrong token.")

    async def logout(self, request: Request) -> Response:
        await checked_form(request)
        request.session.clear()
        return RedirectResponse(request.url_for("queues"), status_code=303)


def _selection(form: Any, where: FailedFilter) -> str:
    """How the audit trail names the dead letters of an action: their ids, or the filter of "all"."""
    if form.get("all") != "1":
        return ", ".join(map(str, _ids(form)))
    parts = [f"{name}={value}" for name, value in where.params().items() if value]
    return " ".join(parts) or "all"


def _safe_next(value: Any) -> str:
    """A local path to go back to after login; anything else (another site) becomes ``/``."""
    if isinstance(value, str) and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/"


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    dashboard: Dashboard = request.app.state.dashboard
    if exc.status_code == 404 and "queue_name" not in request.path_params and "id" not in request.path_params:
        detail = "No such page."
    else:
        detail = exc.detail
    return dashboard.render(
        request, "error.html", status_code=exc.status_code, code=exc.status_code, detail=detail
    )


async def _database_error(request: Request, exc: Exception) -> Response:
    """503 when the database cannot be reached, 500 with PostgreSQL's message for any other error."""
    dashboard: Dashboard = request.app.state.dashboard
    logger.warning("dashboard: database error: %s", exc)
    text = mask_password(str(exc)).strip()
    if isinstance(exc, psycopg.OperationalError | psycopg_pool.PoolTimeout):
        code, detail = 503, f"The database did not answer: {text}"
    else:
        code, detail = 500, f"The database refused the statement: {text}"
    return dashboard.render(request, "error.html", status_code=code, code=code, detail=detail)


def create_app(settings: Settings, store: Store | None = None) -> Starlette:
    """The dashboard as an ASGI application (serve it with uvicorn or any ASGI server).

    Parameters:
      settings(Settings): Database, schema, auth, read-only mode, the workers' heartbeat_timeout.
      store(Store|None): The database layer; by default a pool of 4 connections
        opened and closed with the application (its lifespan), judging workers by
        ``settings.heartbeat_timeout`` (a store given here judges by its own), and a
        second pool of 4 on ``settings.read_url`` for the reads when it is given.

    Returns:
      Starlette: The application.
    """
    store = store or Store(
        settings.url,
        settings.schema,
        broker_channel(settings.url, settings.schema),
        heartbeat_timeout=settings.heartbeat_timeout,
        read_url=settings.read_url,
    )
    dashboard = Dashboard(settings, store)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await store.open()
        try:
            yield
        finally:
            await store.close()

    d = dashboard
    routes = [
        Route("/", d.queues, name="queues"),
        Route("/queues/{queue_name}", d.queue, name="queue"),
        Route("/queues/{queue_name}/purge", d.purge, methods=["POST"], name="purge"),
        Route("/queues/{queue_name}/pause", d.pause, methods=["POST"], name="pause"),
        Route("/queues/{queue_name}/resume", d.resume, methods=["POST"], name="resume"),
        Route("/messages/find", d.find_message, name="find_message"),
        Route("/messages/{id:int}", d.message, name="message"),
        Route("/history", d.history, name="history"),
        Route("/messages/{id:int}/payload", d.message_payload, name="message_payload"),
        Route("/messages/{id:int}/cancel", d.cancel, methods=["POST"], name="cancel"),
        Route("/messages/{id:int}/run-now", d.run_now, methods=["POST"], name="run_now"),
        Route("/schedules", d.schedules, name="schedules"),
        Route("/schedules/toggle", d.toggle_schedule, methods=["POST"], name="toggle_schedule"),
        Route("/schedules/run-now", d.run_schedule_now, methods=["POST"], name="run_schedule_now"),
        Route("/workers", d.workers, name="workers"),
        Route("/limits", d.limits, name="limits"),
        Route("/limits", d.set_limit, methods=["POST"], name="set_limit"),
        Route("/failed", d.failed, name="failed"),
        Route("/failed/retry", d.retry, methods=["POST"], name="retry"),
        Route("/failed/discard", d.discard, methods=["POST"], name="discard"),
        Route("/failed/{id:int}", d.dead_letter, name="dead_letter"),
        Route("/charts", d.charts, name="charts"),
        Route("/audit", d.audit, name="audit"),
        Route("/login", d.login_page, name="login_page"),
        Route("/login", d.login, methods=["POST"], name="login"),
        Route("/logout", d.logout, methods=["POST"], name="logout"),
        Route("/healthz", d.healthz, name="healthz"),
        Mount("/static", StaticFiles(directory=str(resources.files(__package__) / "static")), name="static"),
    ]
    middleware = [
        # First: a request for another host name (DNS rebinding) never reaches a page or a session.
        Middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts)),
        Middleware(
            SessionMiddleware,
            secret_key=settings.session_secret or secrets.token_urlsafe(32),
            session_cookie=SESSION_COOKIE,
            max_age=12 * 3600,
            # lax: a link from elsewhere (an alert) opens the dashboard logged in; POSTs
            # from other sites still carry no cookie, and need the CSRF token anyway.
            same_site="lax",
        ),
        Middleware(Guard, settings=settings, templates=dashboard.templates, throttle=dashboard.throttle),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: _http_error,
            psycopg.Error: _database_error,
            psycopg_pool.PoolTimeout: _database_error,
        },
    )
    app.state.settings = settings
    app.state.dashboard = dashboard
    return app


__all__ = ["LOOPBACK_HOSTS", "MIN_SCHEMA_REVISION", "Settings", "broker_channel", "create_app"]
