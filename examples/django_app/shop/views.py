"""``POST /orders/``: the order and its receipt message commit together, or neither does."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from dramatiq_pg_outbox.django import outbox

from .models import Order
from .tasks import send_receipt


@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    try:
        email = request.POST["email"]
        total_cents = int(request.POST["total_cents"])
    except (KeyError, ValueError):
        return JsonResponse({"error": "email and total_cents (an integer) are required"}, status=400)
    with transaction.atomic(), outbox():
        order = Order.objects.create(email=email, total_cents=total_cents)
        # Written now, on Django's connection, in this transaction: it exists iff the order commits.
        send_receipt.send(order.id)
    return JsonResponse({"order": order.id}, status=201)
