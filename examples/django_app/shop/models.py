"""An order (in the "default" database) and a ledger entry (in the "ledger" database)."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    email = models.EmailField()
    total_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    #: Set by the send_receipt actor, in a worker.
    receipt_sent_at = models.DateTimeField(null=True)


class LedgerEntry(models.Model):
    order_id = models.BigIntegerField()
    amount_cents = models.IntegerField()
    #: Set by the book_entry actor of the ledger's broker.
    booked_at = models.DateTimeField(null=True)


class Refund(models.Model):
    #: A foreign key: PostgreSQL checks it at COMMIT (Django makes it DEFERRABLE INITIALLY DEFERRED).
    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    #: Unique: a second refund with the same reference raises IntegrityError.
    reference = models.CharField(max_length=40, unique=True)
