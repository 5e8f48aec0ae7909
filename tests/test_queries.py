"""The package's SQL: every statement in a .sql file, every name used defined, every query used."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dramatiq_pg_outbox._queries import (
    DASHBOARD_SQL,
    SQL_FILES,
    file_queries,
    fragments,
    queries_for_schema,
    raw_queries,
    with_identifiers,
)

PACKAGE = Path(__file__).resolve().parent.parent / "dramatiq_pg_outbox"
#: Words that open a SQL statement in a Python string literal (keywords are upper case here).
STATEMENT = re.compile(
    r"^\s*(SELECT\s|INSERT\s+INTO|UPDATE\s+\S+\s+(AS\s+\S+\s+)?SET\s|DELETE\s+FROM|WITH\s+\w+\s+AS\s*\(|"
    r"CREATE\s+(TABLE|TEMP|DATABASE|SCHEMA|INDEX)|DROP\s+(TABLE|DATABASE)|ALTER\s|"
    r'LISTEN\s+[{"]|NOTIFY\s+[{"\w]+\s*,|'
    r"COPY\s|COMMENT\s+ON|SET\s+(LOCAL\s+)?\w+\s*=|TRUNCATE\s)"
)


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def _strings(tree: ast.Module) -> list[ast.Constant]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _used_names(path: Path, tree: ast.Module) -> set[str]:
    """Names looked up as ``<...queries...>["name"]`` or run as ``<runtime>.execute("name", ...)``."""
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if "queries" in ast.unparse(node.value) and isinstance(node.slice.value, str):
                used.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            first = node.args[0]
            on_runtime = "runtime" in ast.unparse(node.func.value) + path.name
            # A name, or a choice of two ("a" if ... else "b")
            choices = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
            for choice in choices:
                if node.func.attr == "execute" and on_runtime and isinstance(choice, ast.Constant):
                    if isinstance(choice.value, str) and re.fullmatch(r"[a-z_]+", choice.value):
                        used.add(choice.value)
    return used


def test_no_sql_statement_is_written_in_python() -> None:
    # Given every string literal of the package (docstrings and messages included)
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value.strip()[:60]!r}"
        for path, tree in _modules()
        for node in _strings(tree)
        if STATEMENT.match(node.value)
    ]
    # Then none of them is a statement: they all live in the .sql files
    assert found == []


def test_every_query_name_the_code_uses_is_defined() -> None:
    defined = set(raw_queries())
    dashboard = set(file_queries(DASHBOARD_SQL))
    missing = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path, tree in _modules()
        for name in _used_names(path, tree)
        if name not in (defined | dashboard if path.parent.name == "dashboard" else defined)
    }
    assert missing == set()
    # (the detector finds the lookups: the hot path's names are among them)
    used = set().union(*(_used_names(path, tree) for path, tree in _modules()))
    assert {"claim", "claim_prioritized", "archive", "rescue", "relay_claim", "metrics_gauges"} <= used
    assert "failed_list" in used


def test_every_query_is_used_by_the_package() -> None:
    literals = {
        node.value for path, tree in _modules() if path.name != "_queries.py" for node in _strings(tree)
    }
    unused = {f"{path}: {name}" for path in SQL_FILES for name in file_queries(path) if name not in literals}
    assert unused == set()


def test_the_loader_refuses_a_name_defined_twice_and_fills_identifiers() -> None:
    # Given: names are unique across the broker's files (raw_queries checks it on load)
    assert sum(len(file_queries(p)) for p in SQL_FILES) == len(raw_queries())
    # When a schema and an identifier are filled in
    sql = with_identifiers(queries_for_schema("my_jobs")["listen"], channel='odd"name.x')
    # Then both are quoted, the quote doubled
    assert sql == 'LISTEN "odd""name.x"'
    assert '"my_jobs".messages' in queries_for_schema("my_jobs")["claim"]
    with pytest.raises(ValueError):
        queries_for_schema("no;schema")


def test_comments_never_reach_the_server() -> None:
    for path in (*SQL_FILES, DASHBOARD_SQL):
        for name, sql in file_queries(path).items():
            assert not any(line.lstrip().startswith("--") for line in sql.splitlines()), (path, name)
            assert not sql.endswith(";"), (path, name)


def test_the_rule_of_a_live_worker_is_written_once() -> None:
    # Given every .sql file of the package as written
    texts = [(PACKAGE / path).read_text() for path in (*SQL_FILES, DASHBOARD_SQL)]
    # Then one condition on heartbeat_at decides liveness (the worker_alive fragment) ...
    assert sum(len(re.findall(r"heartbeat_at\s*[<>]", text)) for text in texts) == 1
    rule = fragments()["worker_alive"]
    # ... and the ranking, the rescuer, the gauge and the dashboard all apply it
    for name in ("consumer_rank", "rescue", "metrics_gauges"):
        assert rule in raw_queries()[name], name
    assert rule in file_queries(DASHBOARD_SQL)["workers"]


#: The modules that may look a statement up by name: the typed stores (issue 32), the loader, and
#: _isolation.py, which sits below the stores' layer (every connection, the stores' included, is
#: set to READ COMMITTED by its three statements before any store runs).
LOOKUP_ALLOWED = ("store/", "dashboard/store.py", "_queries.py", "_isolation.py")
#: The loader's functions that hand out statements.
LOADERS = {"file_queries", "queries_for_schema", "raw_queries", "fragments", "with_identifiers"}
#: Names a fetched row or list of rows goes by in the package.
ROW_NAMES = {"row", "rows", "r", "rec", "record", "result", "one", "first"}


def _outside_the_stores() -> list[tuple[str, ast.Module]]:
    return [
        (rel, tree)
        for path, tree in _modules()
        if not (rel := path.relative_to(PACKAGE).as_posix()).startswith(LOOKUP_ALLOWED)
    ]


def _by_position(node: ast.Subscript) -> bool:
    """``x[3]``, ``x[-1]`` or ``x[3:5]``: an index or slice of integer constants."""
    index = node.slice
    if isinstance(index, ast.UnaryOp):
        index = index.operand
    if isinstance(index, ast.Constant):
        return isinstance(index.value, int)
    if isinstance(index, ast.Slice):
        bounds = [b.operand if isinstance(b, ast.UnaryOp) else b for b in (index.lower, index.upper)]
        return all(b is None or (isinstance(b, ast.Constant) and isinstance(b.value, int)) for b in bounds)
    return False


def _fetch(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in {"fetchone", "fetchall", "fetchmany"}
    )


def test_only_the_stores_look_statements_up_by_name() -> None:
    # Given every module of the package but the stores and the loader
    found = []
    for rel, tree in _outside_the_stores():
        for node in ast.walk(tree):
            # When one imports a loader function or looks up queries["name"]
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_queries"):
                found += [f"{rel}:{node.lineno}: imports {a.name}" for a in node.names if a.name in LOADERS]
            elif isinstance(node, ast.Subscript) and "queries" in ast.unparse(node.value).lower():
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    # Then none does: a statement is run through a store's method (dramatiq_pg_outbox/store/)
    assert found == []


def _positional_reads(tree: ast.Module) -> list[ast.AST]:
    """Fetched rows read by position: ``cur.fetchone()[3]``, ``rows[0][3:5]``, ``row[7]``, or a
    fetched row unpacked into names (``a, b = cur.fetchone()``)."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _by_position(node):
            value = node.value
            inner = value.value if isinstance(value, ast.Subscript) else None
            if (
                _fetch(value)
                or (inner is not None and _fetch(inner))
                or (isinstance(value, ast.Name) and value.id in ROW_NAMES - {"rows"})
                or (isinstance(inner, ast.Name) and inner.id in ROW_NAMES)
            ):
                found.append(node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and _fetch(node.value):
            found.append(node)
    return found


def test_no_row_is_read_by_position_outside_the_stores() -> None:
    # Given every module of the package but the stores, when a fetched row is read by position
    found = [
        f"{rel}:{getattr(node, 'lineno', 0)}: {ast.unparse(node)}"
        for rel, tree in _outside_the_stores()
        for node in _positional_reads(tree)
    ]
    # Then none is: rows come back from the stores as typed rows read by name
    assert found == []


def test_the_position_detector_finds_the_shapes_it_looks_for() -> None:
    # Given the shapes the issue found (consumer._fetch's row[7], rows[0][3:5]), a fetch read by
    # position or unpacked, and the first typed row read by name
    source = "row[7]\nrows[0][3:5]\ncur.fetchone()[0]\nd, e = cur.fetchone()\nrows[0].id\nrows[0]"
    # Then the first four are flagged, the typed row and the first of a list are not
    flagged = [ast.unparse(node) for node in _positional_reads(ast.parse(source))]
    assert sorted(flagged) == sorted(["row[7]", "rows[0][3:5]", "cur.fetchone()[0]", "d, e = cur.fetchone()"])
