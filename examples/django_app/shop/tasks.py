"""The shop's actors, found by ``manage.py rundramatiq`` (django_dramatiq imports ``<app>.tasks``)."""

from __future__ import annotations

import dramatiq
from django.utils import timezone

from .models import Order


@dramatiq.actor(max_retries=3)
def send_receipt(order_id: int) -> None:
    """Send the order's receipt (here: record when it was sent)."""
    Order.objects.filter(pk=order_id, receipt_sent_at=None).update(receipt_sent_at=timezone.now())
