"""``python -m examples.periodic_jobs``: run the whole example."""

from __future__ import annotations

from examples.periodic_jobs.run import main

raise SystemExit(main())
