"""OUT/index.html: every document's summary with its citations linked to the chunk
summaries they point at, the reduce tree, failures with their reasons, and timings.
Built from the JSON records in the output folder; every piece of text is escaped."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from conveyor.apps.documents.documents import write_top_file

REPORT_NAME = "index.html"
STYLE = (
    "body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
    ".error{color:#a00}.warning{color:#a60}.cite{font-size:90%}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top}details{margin:.5em 0}"
)


def records_in(out_dir: Path) -> list[dict[str, Any]]:
    """The records (`*.summary.json`) under `out_dir`, by document name; unreadable ones skipped."""
    records = []
    for path in sorted(out_dir.rglob("*.summary.json")):
        if path.is_symlink() or not path.is_file():
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("document"), str):
            records.append(record)
    return sorted(records, key=lambda r: r["document"])


def write_report(out_dir: Path) -> Path:
    """Write OUT/index.html from the records in OUT (atomically: a temporary file, renamed)."""
    write_top_file(out_dir, REPORT_NAME, render(records_in(out_dir)))
    return out_dir / REPORT_NAME


def render(records: list[dict[str, Any]]) -> str:
    done = [r for r in records if r.get("status") == "done"]
    failed = [r for r in records if r.get("status") != "done"]
    warned = sum(bool(r.get("warnings")) for r in done)
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Summaries</title><style>{STYLE}</style>"
        f"</head><body><h1>Summaries</h1><p>{len(done)} documents summarized ({warned} with warnings), "
        f"{len(failed)} failed.</p>"
    ]
    parts.extend(_document(number, record) for number, record in enumerate(done))
    if failed:
        parts.append("<h2>Failures</h2><table><tr><th>document</th><th>reason</th></tr>")
        parts.extend(
            f"<tr><td>{_e(r['document'])}</td><td class='error'>{_e(r.get('error'))}</td></tr>" for r in failed
        )
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "".join(parts)


def _document(number: int, record: dict[str, Any]) -> str:
    anchor = f"d{number}"
    usage = record.get("usage", {})
    head = (
        f"<h2 id='{anchor}'>{_e(record['document'])}</h2><p>{_e(record.get('format'))}, "
        f"{len(record.get('chunks', []))} chunks, {record.get('levels', 0)} levels, "
        f"{usage.get('prompt_tokens', 0)} prompt + {usage.get('completion_tokens', 0)} completion tokens, "
        f"{record.get('wall_s', 0)} s</p>"
    )
    warnings = record.get("warnings") or []
    if warnings:
        head += "<ul class='warning'>" + "".join(f"<li>warning: {_e(w)}</li>" for w in warnings) + "</ul>"
    if record.get("summary_json") is not None:
        body = f"<pre>{_e(json.dumps(record['summary_json'], indent=2, ensure_ascii=False))}</pre>"
    else:
        body = "<ul>" + "".join(_point(anchor, p) for p in record.get("points", [])) + "</ul>"
    chunks = "".join(
        f"<tr id='{anchor}-c{c['index']}'><td>{c['index']}</td><td>{_e(c.get('cite'))}</td>"
        f"<td>{_extractive(c)}{_e(c.get('summary'))}</td></tr>"
        for c in record.get("chunks", [])
    )
    tree = "".join(
        f"<tr><td>{t['level']}.{t['index']}</td><td>{_e(t['inputs'])}</td><td>{_e(t.get('cite'))}</td>"
        f"<td>{_extractive(t)}{_e(t.get('summary'))}</td></tr>"
        for t in record.get("tree", [])
    )
    return (
        head + body + "<details><summary>chunk summaries</summary><table><tr><th>#</th><th>from</th>"
        f"<th>summary</th></tr>{chunks}</table></details>"
        "<details><summary>reduce tree</summary><table><tr><th>node</th><th>inputs</th><th>covers</th>"
        f"<th>summary</th></tr>{tree}</table></details>"
    )


def _extractive(node: dict[str, Any]) -> str:
    return "<em class='warning'>[extractive]</em> " if node.get("extractive") else ""


def _point(anchor: str, point: dict[str, Any]) -> str:
    links = ", ".join(f"<a href='#{anchor}-c{int(i)}'>{int(i)}</a>" for i in point.get("chunks", []))
    return f"<li>{_e(point.get('text'))} <span class='cite'>[{_e(point.get('cite'))}; chunks {links}]</span></li>"


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)
