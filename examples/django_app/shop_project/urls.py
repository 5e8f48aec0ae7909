"""The shop's one URL: ``POST /orders/`` places an order."""

from __future__ import annotations

from django.urls import path
from shop import views

urlpatterns = [path("orders/", views.place_order, name="place_order")]
