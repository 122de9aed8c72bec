"""The light client's subcommands: `submit`, `status` and `dead`.

The `conveyor` command (conveyor/cli.py) calls `register(subparsers)` when one of them
runs. `register` adds `--redis-url`, `--namespace` and the credential flags to each
subcommand (`connection_options`, which the other programs' subcommands share).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import redis

from conveyor.clients.cli_dead import register_dead
from conveyor.clients.cli_usage import register_usage
from conveyor.clients.client import Client, Job
from conveyor.clients.connection import add_connection_arguments, command_settings, refused_message, settings_from_args
from conveyor.clients.errors import ConveyorError, InvalidJob, JobFailed, Timeout
from conveyor.clients.keys import PRIORITY_CLASSES

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# (flag, job field, type) of the sampling and scheduling options of `submit`.
JOB_OPTIONS = [
    ("--max-tokens", "max_tokens", int),
    ("--temperature", "temperature", float),
    ("--top-p", "top_p", float),
    ("--top-k", "top_k", int),
    ("--min-p", "min_p", float),
    ("--repetition-penalty", "repetition_penalty", float),
    ("--presence-penalty", "presence_penalty", float),
    ("--frequency-penalty", "frequency_penalty", float),
    ("--seed", "seed", int),
    ("--min-tokens", "min_tokens", int),
    ("--logprobs", "logprobs", int),
    ("--priority", "priority", int),
    ("--result-ttl", "result_ttl", int),
    ("--job-id", "job_id", str),
    ("--model", "model", str),
]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `submit`, `status`, `dead` and `usage` (each with --redis-url/--namespace)."""
    connection = connection_options()
    _add_submit(subparsers.add_parser("submit", parents=[connection], help="submit jobs and print results"))
    _add_status(subparsers.add_parser("status", parents=[connection], help="show queues and consumers"))
    register_dead(subparsers, connection)
    register_usage(subparsers, connection)


def connection_options() -> argparse.ArgumentParser:
    """--redis-url, --namespace, and the credential/TLS flags of clients/connection.py."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--redis-url",
        default=None,
        help="default: $REDIS_URL, else the local server that `conveyor serve` started (see --data-dir)",
    )
    parent.add_argument("--namespace", default=None, help="key prefix; default: $CONVEYOR_NAMESPACE or conveyor")
    add_connection_arguments(parent)
    return parent


def client_from_args(args: argparse.Namespace) -> Client:
    """The Client of a subcommand: URL, credentials, TLS and namespace from its flags."""
    return Client(namespace=args.namespace, connection=command_settings(args))


def _add_submit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin)")
    parser.add_argument("--file", help="JSONL file, one job object per line ('-' reads stdin)")
    form = parser.add_mutually_exclusive_group()
    form.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user chat message (the default where the model has a chat template)",
    )
    form.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template")
    parser.add_argument("--system", help="system message (implies --chat)")
    for flag, field, kind in JOB_OPTIONS:
        parser.add_argument(flag, dest=field, type=kind, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--priority-class", choices=PRIORITY_CLASSES, default=None)
    parser.add_argument("--deadline-in", type=float, help="deadline, in seconds from now")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--json", action="store_true", help="print results as JSON lines")
    parser.add_argument("--no-wait", action="store_true", help="print job ids and exit")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for each result")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_submit)


def _add_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.set_defaults(func=run_status)


def wait_seconds(text: str) -> float:
    value = float(text)
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


# ---------------------------------------------------------------- submit


def run_submit(args: argparse.Namespace) -> int:
    return reporting_errors(_submit, args)


def _submit(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        if args.file:
            return _submit_file(client, args)
        return _submit_prompt(client, args)


def reporting_errors(command: Any, args: argparse.Namespace) -> int:
    """Run a handler, turning expected failures into one line on stderr and an exit code."""
    try:
        return command(args)
    except InvalidJob as exc:
        return fail(exc.message, EXIT_USAGE)
    except redis.AuthenticationError as exc:
        return fail(refused_message(settings_from_args(args), exc), EXIT_JOB_FAILED)
    except (ConveyorError, redis.RedisError) as exc:  # Timeout is also an OSError: catch first
        return fail(getattr(exc, "message", None) or str(exc), EXIT_JOB_FAILED)
    except OSError as exc:  # unreadable --file
        return fail(str(exc), EXIT_USAGE)


def fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _submit_prompt(client: Client, args: argparse.Namespace) -> int:
    if args.prompt is None:
        print("error: give a prompt or --file", file=sys.stderr)
        return EXIT_USAGE
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    job = client.submit(**_prompt_fields(prompt, args), **_job_options(args))
    if args.no_wait:
        print(job.job_id)
        return EXIT_OK
    if args.stream:
        return _print_stream(job, args)
    return _print_result(job, args.timeout, args.json)


def _prompt_fields(prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """--chat (or --system): chat messages; --raw: the prompt as it is; neither: the prompt with
    chat_template "auto", so the replica applies the model's template where it has one (the
    same command line makes the same job, whenever it runs)."""
    if args.raw and args.system:
        raise InvalidJob("--system needs the chat template: leave out --raw", field="system")
    if args.raw:
        return {"prompt": prompt}
    if not (args.chat or args.system):
        return {"prompt": prompt, "chat_template": "auto"}
    system = [{"role": "system", "content": args.system}] if args.system else []
    return {"messages": [*system, {"role": "user", "content": prompt}]}


def _job_options(args: argparse.Namespace) -> dict[str, Any]:
    names = [field for _, field, _ in JOB_OPTIONS] + ["stop", "ignore_eos", "priority_class"]
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.deadline_in is not None:
        options["deadline"] = time.time() + args.deadline_in
    return options


def _print_stream(job: Job, args: argparse.Namespace) -> int:
    try:
        for event in job.stream(timeout=args.timeout):
            if event.reset:
                print(f"\n[retry: attempt {event.attempt}, restarting output]", file=sys.stderr)
            elif event.resumed_tokens is not None:  # what was printed stays: the output goes on from it
                print(f"\n[attempt {event.attempt} resumed after {event.resumed_tokens} tokens]", file=sys.stderr)
            print(event.text, end="", flush=True)
        print()
        return EXIT_OK
    except (JobFailed, Timeout) as exc:
        print(f"\nerror: {exc.message}", file=sys.stderr)
        return EXIT_JOB_FAILED


def _print_result(job: Job, timeout: float | None, as_json: bool) -> int:
    try:
        result = job.result(timeout=timeout)
    except (JobFailed, Timeout) as exc:
        if as_json:
            print(json.dumps({"job_id": job.job_id, "error": {"code": exc.code, "message": exc.message}}))
        else:
            print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_JOB_FAILED
    print(result.model_dump_json() if as_json else result.text)
    return EXIT_OK


def _submit_file(client: Client, args: argparse.Namespace) -> int:
    items = _read_jsonl(args.file)
    defaults = _job_options(args)
    jobs = client.submit_many([{**defaults, **item} for item in items], progress=not args.quiet)
    if args.no_wait:
        print("\n".join(job.job_id for job in jobs))
        return EXIT_OK
    codes = [_print_result(job, args.timeout, as_json=True) for job in jobs]  # in input order
    return max(codes, default=EXIT_OK)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
    with stream:
        lines = [(n, line) for n, line in enumerate(stream, 1) if line.strip()]
    return [_parse_line(n, line) for n, line in lines]


def _parse_line(number: int, line: str) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidJob(f"line {number}: not valid JSON ({exc})", field="line") from None
    if not isinstance(item, dict):
        raise InvalidJob(f"line {number}: must be a JSON object", field="line")
    return item


# ---------------------------------------------------------------- status


def run_status(args: argparse.Namespace) -> int:
    return reporting_errors(_status, args)


def _status(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        status = client.queue_status()
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return EXIT_OK


def format_status(status: dict[str, Any]) -> str:
    lines = [f"namespace {status['namespace']}"]
    lines += _stream_lines(status["requests"], "  ")
    for model, info in status["models"].items():
        published = f"published, max_model_len {info['max_model_len']}" if info["published"] else "not published"
        lines.append(f"  model {model} ({published})")
        lines += _stream_lines(info["requests"], "    ")
    for model, info in status["models"].items():
        if info["unserved"]:
            why = "no consumers" if info["published"] else "no replica published it"
            lines.append(f"  ! {info['queued']} queued jobs for model {model!r} and no replica serves it ({why})")
    dead = status["dead_letter"]
    lines.append(f"  dead letters {dead['stream']}: length {dead['length']}")
    return "\n".join(lines)


def _stream_lines(requests: dict[str, Any], indent: str) -> list[str]:
    lines = []
    for name, info in requests.items():
        group = f"pending {info['pending']}, lag {info['lag']}" if info["group"] else "no consumer group yet"
        lines.append(f"{indent}{name:<12} {info['stream']}: length {info['length']}, {group}")
        for consumer in info["consumers"]:
            lines.append(
                f"{indent}  consumer {consumer['name']}: pending {consumer['pending']}, idle {consumer['idle_s']:.1f} s"
            )
    return lines
