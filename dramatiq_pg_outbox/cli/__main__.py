"""``python -m dramatiq_pg_outbox.cli``: the ``dramatiq-pg-outbox`` command."""

from __future__ import annotations

from .main import main

raise SystemExit(main())
