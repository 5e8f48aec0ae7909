"""``python -m examples.transactional_email``: run the whole example."""

from __future__ import annotations

from examples.transactional_email.run import main

raise SystemExit(main())
