"""``python -m examples.dashboard_demo``: the web dashboard over a few minutes of real traffic.

A scratch database (``dramatiq_pg_outbox.testing``: ``$DATABASE_URL``'s server, else
a local or throwaway one), a Dramatiq worker with 8 threads and a producer whose rate
rises and falls, for four actors on three queues: quick e-mails that sometimes need
a retry, card charges of which a few are declined (dead letters), slow invoice
renders that back up at peak, and a CRM sync that times out now and then.  The
dashboard serves it all on http://127.0.0.1:8080/ until Ctrl-C.

Two periodic jobs fill the schedules page.  ``--screenshots DIR`` instead takes the
screenshots of the dashboard guide (docs/guides/dashboard.md) with headless Chromium
(Debian's ``chromium`` driven by Playwright) once the traffic ran ``--seconds`` (12
minutes by default, to fill most of the charts' 15-minute window), then stops.
Needs ``pip install -e '.[dev]'``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dramatiq
import uvicorn

from dramatiq_pg_outbox import PostgresBroker, upgrade
from dramatiq_pg_outbox.dashboard.app import Settings, create_app
from dramatiq_pg_outbox.periodic import Periodic, periodic
from dramatiq_pg_outbox.testing import mask_password, postgres_server, scratch_database


class CardDeclined(Exception):
    pass


class SMTPServerDisconnected(ConnectionError):
    pass


def declare_actors(broker: PostgresBroker) -> dict[str, Any]:
    rng = random.Random(7)

    @dramatiq.actor(broker=broker, queue_name="emails", max_retries=2, min_backoff=500, max_backoff=1000)
    def send_welcome_email(user_id: int) -> None:
        time.sleep(rng.uniform(0.005, 0.02))
        if rng.random() < 0.03:
            raise SMTPServerDisconnected(f"smtp.example.com closed the connection (user {user_id})")

    @dramatiq.actor(broker=broker, queue_name="payments", max_retries=0)
    def charge_card(order_id: int, cents: int) -> None:
        time.sleep(rng.uniform(0.02, 0.06))
        if rng.random() < 0.04:
            raise CardDeclined(f"order {order_id}: card declined by the issuer ({cents} cents)")

    @dramatiq.actor(broker=broker, queue_name="reports")
    def render_invoice(order_id: int) -> None:
        time.sleep(rng.uniform(0.1, 0.3))

    @dramatiq.actor(broker=broker, queue_name="payments", max_retries=1, min_backoff=1000, max_backoff=1000)
    def sync_crm(account_id: int) -> None:
        time.sleep(rng.uniform(0.01, 0.04))
        if rng.random() < 0.08:
            raise TimeoutError(f"crm.example.com did not answer within 5 s (account {account_id})")

    @periodic(every=30_000, name="expire-carts")
    @dramatiq.actor(broker=broker, queue_name="maintenance")
    def expire_carts() -> None:
        time.sleep(0.05)

    @periodic("0 7 * * *", name="daily-digest", tz="Europe/Paris")
    @dramatiq.actor(broker=broker, queue_name="emails")
    def send_daily_digest() -> None:
        pass

    return {f.actor_name: f for f in (send_welcome_email, charge_card, render_invoice, sync_crm)}


def produce(
    broker: PostgresBroker, actors: dict[str, Any], stop: threading.Event, started: float, burst_at: float
) -> None:
    """A wave of traffic: 4 to 36 orders per second over a 2-minute period, and at ``burst_at``
    seconds a month-end batch of 1,500 invoices (one ``enqueue_many``) that backs up ``reports``."""
    rng = random.Random(11)
    order = 1000
    burst_done = False
    while not stop.is_set():
        elapsed = time.monotonic() - started
        if elapsed >= burst_at and not burst_done:
            broker.enqueue_many([actors["render_invoice"].message(i) for i in range(1500)])
            burst_done = True
        rate = 20 + 16 * math.sin(2 * math.pi * elapsed / 120)
        for _ in range(max(1, round(rate / 4))):
            order += 1
            actors["charge_card"].send(order, rng.randrange(500, 50_000))
            actors["render_invoice"].send(order)
            if order % 2:
                actors["send_welcome_email"].send(order)
            if order % 3 == 0:
                actors["sync_crm"].send(order)
            if order % 25 == 0:  # a reminder tomorrow: waits in the table as a delayed message
                actors["send_welcome_email"].send_with_options(args=(order,), delay=86_400_000)
        stop.wait(0.25)


def serve(url: str, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(uvicorn.Config(create_app(Settings(url=url)), host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread


def take_screenshots(base: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    shots = []
    with sync_playwright() as playwright:
        chromium = os.environ.get("DPO_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
        browser = playwright.chromium.launch(executable_path=chromium, args=args)
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        pages = (
            ("queues", "/"),
            ("queue", "/queues/reports"),
            ("schedules", "/schedules"),
            ("failed", "/failed"),
            ("charts", "/charts?window=15m"),
        )
        for name, path in pages:
            page.goto(base + path)
            shots.append(out / f"dashboard-{name}.png")
            # A queue's page holds 100 rows: its first screen only.
            page.screenshot(path=str(shots[-1]), full_page=name != "queue")
        browser.close()
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.dashboard_demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--seconds", type=float, default=720, help="traffic before the screenshots")
    parser.add_argument(
        "--screenshots", type=Path, metavar="DIR", help="take screenshots into DIR, then stop"
    )
    args = parser.parse_args(argv)
    # SIGTERM stops it like Ctrl-C: the worker stops and the scratch database is dropped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    with postgres_server() as admin_url, scratch_database(admin_url, "dashboard_demo") as url:
        upgrade(url)
        broker = PostgresBroker(url=url)
        broker.add_middleware(Periodic())  # the schedules page: one scheduler in this worker
        actors = declare_actors(broker)
        worker = dramatiq.Worker(broker, worker_threads=8)
        worker.start()
        stop = threading.Event()
        burst_at = args.seconds - 4 if args.screenshots else 300
        producer = threading.Thread(
            target=produce, args=(broker, actors, stop, time.monotonic(), burst_at), daemon=True
        )
        producer.start()
        server, thread = serve(url, args.port)
        print(f"dashboard of {mask_password(url)} on http://127.0.0.1:{args.port}/", flush=True)
        try:
            if args.screenshots:
                time.sleep(args.seconds)
                for path in take_screenshots(f"http://127.0.0.1:{args.port}", args.screenshots):
                    print(f"screenshot: {path}")
            else:
                print("Ctrl-C to stop", flush=True)
                threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            producer.join()
            server.should_exit = True
            thread.join()
            worker.stop()
            broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
