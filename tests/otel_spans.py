"""Finished OpenTelemetry spans as JSON lines, one file per process (tests/test_tracing.py).

The worker processes of tests/worker_app.py export with :class:`JsonLinesExporter`
(``DPO_OTEL_SPANS=<directory>``); the test reads every file back with :func:`read_spans`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """The parts of a span the tests check, with ids as hex strings (W3C's spelling)."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "links": [f"{link.context.trace_id:032x}-{link.context.span_id:016x}" for link in span.links],
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "events": [event.name for event in span.events],
    }


class JsonLinesExporter(SpanExporter):
    """Appends each finished span to ``<directory>/<pid>.jsonl``, one JSON object per line."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(span)) + "\n" for span in spans)
        with open(self.directory / f"{os.getpid()}.jsonl", "a", encoding="utf-8") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS


def read_spans(directory: Path) -> list[dict[str, Any]]:
    """Every complete line of every process's file."""
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if line.endswith("\n"):
                spans.append(json.loads(line))
    return spans
