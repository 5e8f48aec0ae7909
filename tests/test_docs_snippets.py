"""The documentation's runnable code, run as written: README.md and the pages of docs/ cannot rot.

A page says which of its blocks run with HTML comments (invisible on GitHub and in the site), each
on the line right before a fenced block:

- A block whose info string has ``title="NAME"`` (```` ```python title="quickstart.py" ````,
  which the site shows as the block's caption) is saved as ``NAME`` in the page's working
  directory before any command of the page runs.
- ``<!-- test: run -->`` before a ```` ```sh ```` block: each line (comments stripped) runs with
  bash in that directory, in order, and must exit 0.
- ``<!-- test: background -->`` before a ```` ```sh ```` block: each line starts in the
  background (a worker) in a session of its own, and gets SIGTERM when the page's blocks are done.
- ``<!-- test: output -->`` before a ```` ```console ```` block: each ``$ command`` runs, and its
  standard output must be the lines below it, up to the next ``$``.  Once a background command
  runs, a command whose output differs is tried again for up to 30 s (the worker takes a moment
  to start); before, it runs once (it may change the database).
- ``<!-- test: requires NAME -->`` anywhere on a page: the page is skipped, with the reason, where
  NAME (``redis``, ``rabbitmq``, ``pgbouncer`` or ``spark``) is missing.

Every command gets ``DATABASE_URL``, a fresh database that has never been migrated (dropped at
the end), and the example URL ``postgresql://localhost/quickstart`` in a page's commands is
replaced by it: nothing else changes.  The README's quick start is the main page this runs: its
migrate command, ``quickstart.py`` (a commit and a rollback), a real ``dramatiq`` worker, and the
history it prints.  Other snippets of the guides run in the tests of their feature, which read
them from the page: docs/guides/sqlalchemy.md (tests/test_outbox.py), tracing.md
(tests/test_tracing.py), pgbouncer.md (tests/test_pgbouncer.py), periodic.md's recipe
(tests/test_periodic.py) and security.md (tests/test_security.py).  Every other ```python block
of those pages must at least compile (``test_every_python_block_of_the_docs_compiles``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dramatiq_pg_outbox.testing import scratch_database

from .helpers import reachable

ROOT = Path(__file__).resolve().parent.parent
#: The URL the pages show; the tests put a fresh database's URL in its place.
DOC_URL = "postgresql://localhost/quickstart"
#: How long an ``output`` block's command may take to print what the page says.
OUTPUT_TIMEOUT = 30.0

FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!-- test: (?P<what>[a-z]+)(?: (?P<arg>[^>]*?))? -->[ \t]*\n\Z")
TITLE = re.compile(r'\btitle="(?P<name>[^"]+)"')


@dataclass
class Block:
    info: str
    body: str
    marker: str | None
    line: int


def blocks(text: str) -> Iterator[Block]:
    """The fenced blocks of a page, each with the ``test:`` marker on the line right before it."""
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        last_line = before[before.rstrip("\n").rfind("\n") + 1 :]
        marker = MARKER.match(last_line)
        yield Block(
            info=match["info"].strip(),
            body=match["body"],
            marker=marker["what"] if marker else None,
            line=before.count("\n") + 1,
        )


def pages() -> list[Path]:
    """README.md and every page of docs/ that marks a block to run."""
    found = [ROOT / "README.md"]
    found += sorted(p for p in (ROOT / "docs").rglob("*.md") if "<!-- test: " in p.read_text())
    return found


def _missing(requirement: str) -> str | None:
    """Why ``requirement`` is not available here, or None."""
    if requirement == "redis":
        return None if reachable("127.0.0.1", 6379) else "no Redis server at 127.0.0.1:6379"
    if requirement == "rabbitmq":
        return None if reachable("127.0.0.1", 5672) else "no RabbitMQ server at 127.0.0.1:5672"
    if requirement == "pgbouncer":
        found = shutil.which("pgbouncer") or os.path.exists("/usr/sbin/pgbouncer")
        return None if found else "PgBouncer is missing (apt-get install -y pgbouncer)"
    if requirement == "spark":
        if importlib.util.find_spec("pyspark") is None:
            return "pyspark is not installed (pip install -e '.[dev]')"
        return (
            None if shutil.which("java") else "Java is missing (apt-get install -y openjdk-17-jre-headless)"
        )
    raise AssertionError(f"unknown requirement {requirement!r} (redis, rabbitmq, pgbouncer, spark)")


def _commands(body: str) -> list[str]:
    """The command lines of a shell block, comments and blank lines left out."""
    lines = [line.split(" #", 1)[0].strip() for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _console(body: str) -> list[tuple[str, list[str]]]:
    """The ``$ command`` lines of a console block, each with the output lines shown below it."""
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"output before any command: {line!r}"
            steps[-1][1].append(line.rstrip())
    for _, expected in steps:
        while expected and not expected[-1]:
            expected.pop()
    return steps


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_marked_blocks_of_the_page_run_as_written(page: Path, admin_url: str, tmp_path: Path) -> None:
    text = page.read_text()
    for requirement in re.findall(r"<!-- test: requires ([a-z]+) -->", text):
        reason = _missing(requirement)
        if reason:
            pytest.skip(f"{page.name} needs {requirement}: {reason}")
    found = [b for b in blocks(text) if b.marker not in (None, "requires")]
    assert found, f"{page}: no block marked to run"
    # The files first, as a reader saves them before running the commands.
    for block in blocks(text):
        title = TITLE.search(block.info)
        if title:
            (tmp_path / title["name"]).write_text(block.body)
    background: list[subprocess.Popen[bytes]] = []
    with scratch_database(admin_url, "dpo_test_docs") as url:
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            # `python`, `dramatiq` and `dramatiq-pg-outbox` of this interpreter's environment first.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        }

        def run(command: str, where: str) -> subprocess.CompletedProcess[str]:
            command = command.replace(DOC_URL, url)
            done = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"{where}: `{command}` exited {done.returncode}:\n{done.stderr}"
            return done

        try:
            for block in found:
                where = f"{page.relative_to(ROOT)}:{block.line}"
                if block.marker == "run":
                    assert block.info.split()[0] == "sh", f"{where}: run marks a ```sh block"
                    for command in _commands(block.body):
                        run(command, where)
                elif block.marker == "background":
                    assert block.info.split()[0] == "sh", f"{where}: background marks a ```sh block"
                    for command in _commands(block.body):
                        log = open(tmp_path / f"background-{len(background)}.log", "wb")
                        background.append(
                            subprocess.Popen(
                                ["bash", "-c", f"exec {command.replace(DOC_URL, url)}"],
                                cwd=tmp_path,
                                env=env,
                                stdout=log,
                                stderr=subprocess.STDOUT,
                                start_new_session=True,
                            )
                        )
                        log.close()
                elif block.marker == "output":
                    assert block.info.split()[0] == "console", f"{where}: output marks a ```console block"
                    for command, expected in _console(block.body):
                        deadline = time.monotonic() + (OUTPUT_TIMEOUT if background else 0)
                        while True:
                            printed = [line.rstrip() for line in run(command, where).stdout.splitlines()]
                            while printed and not printed[-1]:
                                printed.pop()
                            if printed == expected or time.monotonic() > deadline:
                                break
                            time.sleep(0.5)
                        assert printed == expected, (
                            f"{where}: `{command}` printed {printed}, the page says {expected}"
                        )
                else:
                    raise AssertionError(f"{where}: unknown marker {block.marker!r}")
        finally:
            for process in background:
                _stop(process)
    for i in range(len(background)):
        # A worker that stopped early (a wrong module name, an import error) is a broken page.
        log = (tmp_path / f"background-{i}.log").read_text(errors="replace")
        assert "Traceback" not in log, log


def test_the_readme_quick_start_is_marked_to_run_and_shared_with_the_site() -> None:
    # Given the README's quick start
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("<!-- --8<-- [start:quickstart] -->", 1)[1].split(
        "<!-- --8<-- [end:quickstart] -->"
    )[0]
    marked = [(b.marker, b.info.split()[0]) for b in blocks(quick)]
    # Then it migrates, runs the script, a worker, and shows history: nothing of it is left unrun
    assert marked == [
        ("run", "sh"),
        (None, "python"),
        ("output", "console"),
        ("background", "sh"),
        ("output", "console"),
    ], marked
    assert 'title="quickstart.py"' in quick and DOC_URL in quick
    # And the site's getting-started page includes that very section
    assert '--8<-- "README.md:quickstart"' in (ROOT / "docs" / "getting-started.md").read_text()


def test_the_readme_keeps_the_commands_ci_runs_and_stays_short() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "pip install -e '.[dev]' && python -m pytest -n 2 --dist loadfile"
    assert f"```sh\n{test_command}\n```" in readme and ci.rstrip().endswith(test_command)
    assert "```sh\npip install -e '.[example]' && python -m examples.transactional_email\n```" in readme


def test_the_readmes_links_reach_files_of_the_repository() -> None:
    # The README is read on disk or on a forge, not in the site: its relative links name files.
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((?!https?://)([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert len(links) > 20
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing


def python_blocks() -> Iterator[tuple[str, Block]]:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in blocks(page.read_text()):
            if block.info.split()[:1] == ["python"]:
                yield f"{page.relative_to(ROOT)}:{block.line}", block


def test_every_python_block_of_the_docs_compiles() -> None:
    # Fragments (a `broker` defined elsewhere) need not run, but they must be Python.
    checked = 0
    for where, block in python_blocks():
        compile(block.body, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        checked += 1
    assert checked >= 15


def test_the_markers_are_read_strictly() -> None:
    # The markers are read strictly: a marker on the line before the fence, nothing in between.
    text = "<!-- test: run -->\n```sh\necho hi\n```\n\n<!-- test: run -->\n\n```sh\necho no\n```\n"
    assert [(b.marker, b.body) for b in blocks(text)] == [("run", "echo hi\n"), (None, "echo no\n")]
    assert _commands("export A=1   # a comment\n# only a comment\n\nls\n") == ["export A=1", "ls"]
    assert _console("$ a\nx\n\n$ b\n") == [("a", ["x"]), ("b", [])]
