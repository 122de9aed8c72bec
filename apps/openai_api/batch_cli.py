"""`conveyor batch INPUT.jsonl OUTPUT.jsonl`: the Batch API's machinery without HTTP.

Reads the OpenAI / `vllm run-batch` line format (`{"custom_id", "method": "POST", "url":
"/v1/chat/completions" or "/v1/completions", "body"}`), runs every line as a queue job at
`batch` priority and writes one output line per request, in input order (errors
included, as `vllm run-batch` does). The batch lives in Redis like one made through
the gateway: its id hashes the input and the model, so running the same command again
(after Ctrl-C, a crash, or once it finished) resumes it, and finished jobs are reused.
A gateway may also pick it up while this command is not running.

Exit status: 0 completed (failed requests are error lines in OUTPUT), 1 the batch did
not complete (failed validation, cancelled, expired) or Redis failed, 2 bad usage,
130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
from tqdm import tqdm

from conveyor.apps.openai_api.batch_runner import BatchRun, Lease, LeaseLost, RunnerSettings, new_owner
from conveyor.apps.openai_api.batch_store import ANY_ENDPOINT, TERMINAL, BatchStore, FileTooLarge, check_jsonl
from conveyor.clients.async_client import AsyncClient
from conveyor.clients.cli import connection_options
from conveyor.clients.connection import command_settings
from conveyor.clients.errors import ConveyorError
from conveyor.clients.model_info import DEFAULT_MODEL_WAIT_S, wait_for_model_info_async

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
RESTARTED = ("cancelled", "expired")  # a rerun starts a new batch (reusing the finished jobs)
MAX_GENERATIONS = 100


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `conveyor batch` (registered by conveyor/cli.py)."""
    parser = subparsers.add_parser(
        "batch",
        parents=[connection_options()],
        description=__doc__.split("\n\n")[1],
        help="run an OpenAI batch file through the queue (resumable)",
    )
    parser.add_argument("input", metavar="INPUT.jsonl", help="requests, one JSON line each")
    parser.add_argument("output", metavar="OUTPUT.jsonl", help="results, one JSON line per request")
    parser.add_argument(
        "--model",
        default=None,
        help="model every request runs on (replaces the lines' model); default: the only published one",
    )
    parser.add_argument(
        "--max-in-flight",
        type=_positive(int),
        default=RunnerSettings.max_in_flight,
        help=f"jobs queued or running at once; default: {RunnerSettings.max_in_flight}",
    )
    parser.add_argument(
        "--wait-s",
        type=_non_negative,
        default=DEFAULT_MODEL_WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for a replica serving the model; default: {DEFAULT_MODEL_WAIT_S:g}",
    )
    parser.add_argument(
        "--lease-s",
        type=_positive(float),
        default=RunnerSettings.lease_s,
        help="lease on the batch: how soon another runner may take over a killed run; "
        f"default: {RunnerSettings.lease_s:g}",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_batch)


def run_batch(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_batch(args))
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume (finished requests are reused)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, FileTooLarge, UnicodeDecodeError) as exc:
        return _fail(f"{args.input}: {exc}", EXIT_USAGE)
    except (ConveyorError, redis.RedisError) as exc:
        return _fail(getattr(exc, "message", None) or str(exc), EXIT_FAILED)


async def _batch(args: argparse.Namespace) -> int:
    content = Path(args.input).read_bytes()
    lines = check_jsonl(content)
    settings = RunnerSettings(max_in_flight=args.max_in_flight, lease_s=args.lease_s)
    async with AsyncClient(namespace=args.namespace, connection=command_settings(args)) as client:
        info = await wait_for_model_info_async(
            client.redis, client.keys, args.model, args.wait_s, progress=not args.quiet
        )
        store = BatchStore(client.redis, client.keys.ns)
        batch_id = await _open_batch(store, content, lines, Path(args.input).name, info.name)
        with tqdm(total=lines, unit="req", desc=batch_id, disable=args.quiet) as bar:
            status, run = await _drive(store, client, batch_id, settings, bar)
        return await _finish(store, batch_id, status, run, content, args.output)


def _ids(content: bytes, model: str) -> tuple[str, str]:
    """(batch id base, input file id): hashes of what the batch computes."""
    digest = hashlib.sha256(content + b"\0" + model.encode()).hexdigest()
    return f"batch_cli_{digest[:24]}", f"file-cli-{digest[:24]}"


async def _open_batch(store: BatchStore, content: bytes, lines: int, filename: str, model: str) -> str:
    """The batch of this input: the existing one to resume or reuse, else a new one."""
    base, file_id = _ids(content, model)
    if await store.get_file(file_id) is None:
        await store.put_file(content, filename=filename, purpose="batch", file_id=file_id, lines=lines)
    for generation in range(MAX_GENERATIONS):
        batch_id = base if generation == 0 else f"{base}-{generation}"
        batch, created = await store.create_batch(
            input_file_id=file_id,
            endpoint=ANY_ENDPOINT,
            completion_window="24h",
            metadata={"source": "conveyor batch", "input": filename[:512]},
            batch_id=batch_id,
            model_override=model,
            job_key=base,
        )
        if created or batch["status"] not in RESTARTED:
            print(
                f"batch {batch_id}: {'new' if created else batch['status']}, {lines} requests, model {model}",
                file=sys.stderr,
            )
            return batch_id
    raise ConveyorError(f"{base}: {MAX_GENERATIONS} batches of this input were cancelled or expired")


async def _drive(
    store: BatchStore, client: AsyncClient, batch_id: str, settings: RunnerSettings, bar: tqdm
) -> tuple[str, BatchRun | None]:
    """Run the batch here while its lease is ours; wait while another runner holds it."""
    owner, run, waiting_said = new_owner(), None, False
    while True:
        batch = await store.get_batch(batch_id)
        if batch is None or batch["status"] in TERMINAL:
            return (batch or {}).get("status", "gone"), run
        lease = Lease(store, batch_id, owner, settings)
        if await lease.claim():
            run = BatchRun(store, client, batch_id, lease, settings, on_progress=_progress_to(bar))
            try:
                await run.run()
            except LeaseLost:
                pass
            finally:
                await lease.release()
            continue
        if not waiting_said:
            print(
                f"batch {batch_id} is being run by another runner; waiting for it (or for its lease to expire)",
                file=sys.stderr,
            )
            waiting_said = True
        counts = batch["request_counts"]
        _progress_to(bar)(counts["completed"] + counts["failed"], counts["total"] or bar.total)
        await asyncio.sleep(min(1.0, max(0.05, await store.lease_left_ms(batch_id) / 1000)))


def _progress_to(bar: tqdm):
    def update(done: int, total: int) -> None:
        bar.total, bar.n = total, done
        bar.refresh()

    return update


async def _finish(
    store: BatchStore, batch_id: str, status: str, run: BatchRun | None, content: bytes, output: str
) -> int:
    batch = await store.get_batch(batch_id) or {}
    if status == "failed":
        for error in (batch.get("errors") or {}).get("data", []):
            print(f"error: line {error['line']}: [{error['code']}] {error['message']}", file=sys.stderr)
        return _fail(f"batch {batch_id} failed validation: nothing was run", EXIT_FAILED)
    written = await _write_output(store, batch, content, output)
    counts = batch.get("request_counts") or {}
    jobs = f"; jobs {run.submitted} submitted, {run.reused} reused" if run else "; all jobs reused"
    print(
        f"batch {batch_id}: {status}, {counts.get('completed', 0)} ok, {counts.get('failed', 0)} failed of "
        f"{counts.get('total', 0)}{jobs} -> {output} ({written} lines)",
        file=sys.stderr,
    )
    return EXIT_OK if status == "completed" else EXIT_FAILED


async def _write_output(store: BatchStore, batch: dict[str, Any], content: bytes, output: str) -> int:
    """The output and error files merged in input order, written by rename."""
    by_custom_id: dict[str, bytes] = {}
    for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
        for line in ((await store.file_content(file_id)) if file_id else b"").splitlines():
            by_custom_id[json.loads(line)["custom_id"]] = line
    ordered = [by_custom_id.pop(cid) for cid in _custom_ids(content) if cid in by_custom_id]
    _write_atomically(Path(output), b"".join(line + b"\n" for line in ordered))
    return len(ordered)


def _custom_ids(content: bytes) -> list[str]:
    return [json.loads(line)["custom_id"] for line in content.splitlines() if line.strip()]


def _write_atomically(path: Path, data: bytes) -> None:
    handle, temp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value
