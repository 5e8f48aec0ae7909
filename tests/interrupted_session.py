"""The inner test session of tests/test_interrupted_session.py (not collected on its own).

It starts what tests start (a supervised ``dramatiq`` CLI, a second CLI, and a process no
fixture knows about), says it is ready by writing its database's name to
``$DPO_INNER_READY``, and then waits to be interrupted: by SIGINT (Ctrl-C) from the outer
test, or, with ``DPO_INNER_MODE=timeout``, by pytest-timeout's alarm, brought forward to 1 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.helpers import Supervisor, count, wait_for


def test_starts_processes_then_is_interrupted(worker_process: Any, database_url: str, db: Any) -> None:
    Supervisor(worker_process, processes=1, threads=1)
    worker_process(processes=1, threads=1)
    subprocess.Popen(["sleep", "600"], start_new_session=True)  # stopped by no fixture
    wait_for(lambda: count(db, "SELECT count(*) FROM dramatiq.workers") == 2, 60, "both workers")
    Path(os.environ["DPO_INNER_READY"]).write_text(database_url.rsplit("/", 1)[1])
    if os.environ.get("DPO_INNER_MODE") == "timeout":
        signal.setitimer(signal.ITIMER_REAL, 1.0)  # pytest-timeout's own alarm, due in 1 s
    time.sleep(120)
