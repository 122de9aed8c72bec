"""`conveyor summarize`: documents summarized through the queue (map-reduce, resumable), and
`--watch INBOX`. Registered by the `conveyor` command (conveyor/cli.py) when the
`documents` extra is installed."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from conveyor.apps.documents.documents import printable
from conveyor.apps.documents.summarize import summarize_documents_async
from conveyor.apps.documents.summarize_watch import watch_folder_async
from conveyor.apps.documents.summary_prompts import SummarizeOptions
from conveyor.clients.async_client import AsyncClient
from conveyor.clients.cli import (
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    connection_options,
    fail,
    reporting_errors,
    wait_seconds,
)
from conveyor.clients.connection import command_settings, settings_from_args
from conveyor.clients.keys import PRIORITY_CLASSES
from conveyor.clients.model_info import DEFAULT_MODEL_WAIT_S

# Every document summarized, some with warnings (a thin or partly extractive summary: see
# grounding.py); a failed document still exits EXIT_JOB_FAILED, which wins.
EXIT_DONE_WITH_WARNINGS = 3

# (flag, SummarizeOptions field, type) of `summarize`.
SUMMARIZE_OPTIONS = [
    ("--model", "model", str),
    ("--max-tokens", "max_tokens", int),
    ("--max-chunk-tokens", "max_chunk_tokens", int),
    ("--context-tokens", "context_tokens", int),
    ("--overlap-tokens", "overlap_tokens", int),
    ("--instruction", "map_instruction", str),
    ("--reduce-instruction", "reduce_instruction", str),
    ("--system", "system_prompt", str),
    ("--temperature", "temperature", float),
    ("--repetition-penalty", "repetition_penalty", float),
    ("--max-in-flight", "max_in_flight", int),
    ("--job-timeout", "job_timeout", float),
    ("--result-ttl", "result_ttl", int),
]


# What `summarize --help` says about paths: which files are read, how outputs are named.
SUMMARIZE_DESCRIPTION = (
    "Summarize PDF, DOCX, HTML, Markdown, reST and text files through the queue (map-reduce over "
    "token-budgeted chunks that follow pages and headings; each point of a summary cites its pages "
    "or heading; OUT/index.html reports them all); a rerun reuses finished jobs. Folders are read recursively; hidden files and folders (names "
    "starting with '.') are skipped. Symbolic links inside a folder, to files or to folders, "
    "are never followed: each one is reported as an error line (as is anything that is not a "
    "regular file) and the other documents are still summarized. A PATH you name may itself "
    "be a symbolic link, to a file or a folder: it is followed. Each document writes "
    "NAME.summary.txt and NAME.summary.json under --out, NAME being its path inside its folder "
    "(a/b.txt) or its file name; unsafe names are sanitized, not refused: empty and '.' parts "
    "are dropped, control characters and leading dots become '_' (so '..' becomes '__' and "
    "'.notes' becomes '_notes'). Outputs are written to a temporary file and renamed, so a "
    "symbolic link already at an output path is replaced, never written through; a symbolic "
    "link to a folder inside --out makes that document an error. Names in the lines printed are "
    "escaped (a control character shows as \\x1b, \\n...). A document is an error when any of its jobs "
    "failed or answered nothing; the line names the job id. Every point must be grounded in the "
    "chunks it cites (content words shared); filler and unsupported points are dropped, and a chunk "
    "the model twice answered with nothing usable is summarized by its most salient sentences. "
    "Exit status: 0 every document done cleanly; 3 every document done, some with warnings (fewer "
    "than 2 grounded points, or extractive chunk summaries; printed as 'warning:' lines and kept in "
    "the JSON record and the report); 1 a document failed; 2 usage; 130 interrupted."
)
SUMMARIZE_PATHS_HELP = (
    "PDF, DOCX, HTML, Markdown, reST or text files (told apart by content), or folders of "
    "them (recursively; symlinks inside folders are skipped)"
)
SUMMARIZE_OUT_HELP = "output folder, created if missing; it may itself be a symlink (default: ./summaries)"


def _add_summarize(parser: argparse.ArgumentParser) -> None:
    parser.description = SUMMARIZE_DESCRIPTION
    parser.add_argument("paths", nargs="*", metavar="PATH", help=SUMMARIZE_PATHS_HELP)
    parser.add_argument("--out", default="summaries", help=SUMMARIZE_OUT_HELP)
    parser.add_argument(
        "--watch",
        metavar="INBOX",
        help="keep summarizing new and changed files of this folder, "
        "each content once, until SIGTERM/SIGINT (then the documents in flight finish)",
    )
    parser.add_argument("--poll-s", type=float, default=2.0, help="--watch: seconds between looks at INBOX")
    parser.add_argument(
        "--schema",
        metavar="FILE.json",
        help="JSON schema every map and reduce step answers "
        "under (structured outputs); the final JSON is validated against it",
    )
    for flag, field, kind in SUMMARIZE_OPTIONS:
        info = SummarizeOptions.model_fields[field]
        help_text = f"{info.description}; default: {info.default}" if info.description else f"default: {info.default}"
        parser.add_argument(flag, dest=field, type=kind, default=None, help=help_text.replace("%", "%%"))
    parser.add_argument("--priority-class", choices=PRIORITY_CLASSES, default=None, help="default: batch")
    parser.add_argument(
        "--wait-s",
        type=wait_seconds,
        default=DEFAULT_MODEL_WAIT_S,
        metavar="SECONDS",
        help="how long to wait for a replica to publish its model info, e.g. while replicas "
        f"load their model (0: fail at once); default: {DEFAULT_MODEL_WAIT_S:g}",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars (and no waiting lines)")
    parser.set_defaults(func=run_summarize)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "summarize",
        parents=[connection_options()],
        help="summarize documents (map-reduce through the queue, resumable)",
    )
    _add_summarize(parser)


def run_summarize(args: argparse.Namespace) -> int:
    try:
        return reporting_errors(_summarize, args)
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume (finished jobs are reused)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _summarize(args: argparse.Namespace) -> int:
    names = [field for _, field, _ in SUMMARIZE_OPTIONS] + ["priority_class"]
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if bool(args.paths) == bool(args.watch):
        return fail("summarize: give PATH arguments or --watch INBOX (one of the two)", EXIT_USAGE)
    if args.schema:
        try:
            options["schema"] = json.loads(Path(args.schema).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return fail(f"--schema {args.schema}: cannot read a JSON schema there ({exc})", EXIT_USAGE)
    try:
        if args.watch:
            asyncio.run(_watch_on_client(args, options))
            return EXIT_OK
        results = asyncio.run(_summarize_on_client(args, options))
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        return fail(f"invalid option {'.'.join(map(str, error['loc']))}: {error['msg']}", EXIT_USAGE)
    for result in results:
        print(printable(_summary_line(result.record)), file=sys.stdout if result.ok else sys.stderr)
        for warning in result.warnings if result.ok else []:
            print(printable(f"warning: {result.name}: {warning}"), file=sys.stderr)
    return exit_status(results)


def exit_status(results: list) -> int:
    """EXIT_JOB_FAILED when a document failed, else EXIT_DONE_WITH_WARNINGS when a summary has
    warnings, else EXIT_OK."""
    if not all(r.ok for r in results):
        return EXIT_JOB_FAILED
    return EXIT_DONE_WITH_WARNINGS if any(r.warnings for r in results) else EXIT_OK


async def _summarize_on_client(args: argparse.Namespace, options: dict[str, Any]) -> list:
    """summarize_documents on a client with this command's URL, credentials and TLS."""
    async with AsyncClient(namespace=args.namespace, connection=command_settings(args)) as client:
        return await summarize_documents_async(
            args.paths, args.out, client=client, progress=not args.quiet, wait_s=args.wait_s, **options
        )


async def _watch_on_client(args: argparse.Namespace, options: dict[str, Any]) -> None:
    async with AsyncClient(namespace=args.namespace, connection=settings_from_args(args)) as client:
        await watch_folder_async(
            args.watch,
            args.out,
            client=client,
            poll_s=args.poll_s,
            wait_s=args.wait_s,
            progress=None if args.quiet else sys.stderr,
            **options,
        )


def _summary_line(record: dict[str, Any]) -> str:
    """One document's result line (printed escaped: names and paths may hold control characters)."""
    if record["status"] == "error":
        return f"error: {record['error']}"
    jobs, warnings = record["jobs"], len(record.get("warnings") or [])
    warned = f", {warnings} warning{'s' if warnings > 1 else ''}" if warnings else ""
    return (
        f"{record['document']}: {len(record['chunks'])} chunks, {len(jobs)} jobs ({record['submitted']} "
        f"submitted, {record['reused']} reused){warned}, {record['wall_s']:.1f} s -> {record['summary_file']}"
    )
