"""Place one order, then hang right after its COMMIT until killed (run by test_processes.py).

``python -m shop.tests.place_order_then_hang outbox``: through the view (``atomic()`` and
``outbox()``); ``on_commit``: the usual django_dramatiq way, ``transaction.on_commit(lambda:
send_receipt.send(order.id))``.  The order is placed inside an outer ``atomic()`` whose first
``on_commit`` callback prints ``committed`` and sleeps: the process dies where a web process
that crashes (OOM, SIGKILL, a deploy) right after its COMMIT would, before any callback ran.
"""

from __future__ import annotations

import sys
import time

import django


def hang() -> None:
    print("committed", flush=True)
    time.sleep(600)


def main(how: str) -> None:
    django.setup()
    from django.db import transaction
    from django.test import Client

    from shop.models import Order
    from shop.tasks import send_receipt

    with transaction.atomic():
        transaction.on_commit(hang)
        if how == "outbox":
            response = Client().post("/orders/", {"email": "ada@example.com", "total_cents": "1250"})
            assert response.status_code == 201, response.content
        else:
            order = Order.objects.create(email="ada@example.com", total_cents=1250)
            transaction.on_commit(lambda: send_receipt.send(order.id))


if __name__ == "__main__":
    main(sys.argv[1])
