"""Conventions of the package's source that no linter checks."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dramatiq_pg_outbox"


def orphaned_doc_comments(source: str) -> list[int]:
    """Lines of the ``#:`` comment blocks in ``source`` that do not precede an assignment.

    A ``#:`` block documents the assignment on the line after it (Sphinx and mkdocstrings read
    it so); one followed by anything else documents nothing, typically after the assignment moved.
    """
    assigned = {
        node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign | ast.AnnAssign)
    }
    lines = source.splitlines()
    orphans = []
    for number, line in enumerate(lines, start=1):
        if not line.lstrip().startswith("#:"):
            continue
        following = lines[number] if number < len(lines) else ""
        if following.lstrip().startswith("#:"):
            continue  # the block goes on
        if number + 1 not in assigned:
            orphans.append(number)
    return orphans


def test_orphaned_doc_comments_are_found() -> None:
    source = "#: Documented.\nX = 1\n#: A block\n#: of two lines.\ny: int = 2\n"
    source += "#: Left behind.\n\ndef f(): ...\n"
    assert orphaned_doc_comments(source) == [6]


def test_every_doc_comment_documents_an_assignment() -> None:
    found = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := orphaned_doc_comments(path.read_text()))
    }
    assert found == {}, "#: comments not followed by the assignment they document (file: lines)"
