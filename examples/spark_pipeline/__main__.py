"""``python -m examples.spark_pipeline``: run the example (see run.py)."""

from __future__ import annotations

import sys

from .run import main

sys.exit(main())
