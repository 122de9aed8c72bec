"""`conveyor summarize --watch INBOX --out OUT`: summarize documents as they appear or
change in a folder, each content once, across restarts.

- Polling: every `poll_s` seconds the inbox is listed (recursively; hidden names and
  symlinks skipped); a file is taken once its size and mtime held still for one poll (so a
  file being copied in is not read half-written).
- Links: the inbox is listed and each file read by descriptor, one path component at a
  time with O_NOFOLLOW, and fstat must say a regular file (documents.list_files,
  read_inside), so a folder or file swapped for a symlink between the listing and the
  read is reported, never read through.
- Printing: names are escaped (documents.printable) in every line, so a file name cannot
  send terminal escapes or forge a line.
- Once per content: OUT/.conveyor-watch.json maps each document to the sha256 of the bytes
  last summarized (or failed); the same bytes are never summarized again, changed bytes are.
- Restarts: job ids are hashes of what they compute (summary_prompts.job_id), so a
  document interrupted by a crash or kill -9 resumes: finished chunks are reused, never
  resubmitted. On SIGTERM or SIGINT, no new document is started and those in flight finish.
- A progress line on stderr: documents done / failed / in flight, jobs, tokens, ETA.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, TextIO

from conveyor.apps.documents.documents import (
    SkippedFile,
    document_from_bytes,
    list_files,
    printable,
    read_inside,
    safe_name,
    write_top_file,
)
from conveyor.apps.documents.summarize import DocumentSummary, PipelineRun
from conveyor.apps.documents.summary_prompts import SummarizeOptions
from conveyor.apps.documents.summary_report import write_report
from conveyor.clients.async_client import AsyncClient
from conveyor.clients.model_info import DEFAULT_MODEL_WAIT_S, wait_for_model_info_async

STATE_NAME = ".conveyor-watch.json"
PROGRESS_EVERY_S = 2.0


def watch_folder(
    inbox: str | Path, out_dir: str | Path, *, redis_url: str | None = None, namespace: str | None = None, **kwargs: Any
) -> None:
    """Blocking watch_folder_async on a client of its own, until SIGTERM or SIGINT."""

    async def main() -> None:
        async with AsyncClient(redis_url, namespace) as client:
            await watch_folder_async(inbox, out_dir, client=client, **kwargs)

    asyncio.run(main())


async def watch_folder_async(
    inbox: str | Path,
    out_dir: str | Path,
    *,
    client: AsyncClient,
    stop: asyncio.Event | None = None,
    poll_s: float = 2.0,
    max_documents: int = 2,
    wait_s: float = DEFAULT_MODEL_WAIT_S,
    progress: TextIO | None = sys.stderr,
    **options: Any,
) -> None:
    """Watch `inbox` until `stop` is set (by default on SIGTERM/SIGINT), then finish the
    documents in flight. `options` are SummarizeOptions fields."""
    settings = SummarizeOptions(**options)
    stop = stop or _stop_on_signals()
    info = await wait_for_model_info_async(client.redis, client.keys, settings.model, wait_s, progress is not None)
    run = PipelineRun(client, info, settings, Path(out_dir), False, 0)
    watcher = _Watcher(Path(inbox), Path(out_dir), run, max_documents, progress)
    try:
        await watcher.run(stop, poll_s)
    finally:
        run.close()


def _stop_on_signals() -> asyncio.Event:
    stop, loop = asyncio.Event(), asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    return stop


class _Watcher:
    """The inbox's last listing, the state of finished contents, the documents in flight."""

    def __init__(
        self, inbox: Path, out_dir: Path, run: PipelineRun, max_documents: int, progress: TextIO | None
    ) -> None:
        self.inbox, self.out_dir, self.pipeline, self.progress = inbox, out_dir, run, progress
        self.state = _read_state(out_dir)
        self.seen: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) at the last poll
        self.handled: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) when last taken
        self.in_flight: dict[str, asyncio.Task] = {}
        self.slots = asyncio.Semaphore(max_documents)
        self.done = self.failed = 0
        self.started, self.last_line = time.monotonic(), 0.0

    async def run(self, stop: asyncio.Event, poll_s: float) -> None:
        while not stop.is_set():
            for name, path in self._ready_files():
                self.in_flight[name] = asyncio.create_task(self._document(name, path))
            self._report_progress()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)
        self._line("stopping: finishing the documents in flight", force=True)
        await asyncio.gather(*self.in_flight.values(), return_exceptions=True)
        self._report_progress(force=True)

    def _ready_files(self) -> list[tuple[str, Path]]:
        """Files whose size and mtime held still since the last poll and that are not in flight."""
        listing = dict(list_files(self.inbox))
        ready = [
            (name, self.inbox / name)
            for name, key in listing.items()
            if self.seen.get(name) == key != self.handled.get(name) and name not in self.in_flight
        ]
        self.seen = listing
        self.handled.update((name, listing[name]) for name, _ in ready)
        return ready

    async def _document(self, name: str, path: Path) -> None:
        try:
            data = await asyncio.to_thread(read_inside, self.inbox, name)
            digest = hashlib.sha256(data).hexdigest()
            if self.state.get(name) == digest:
                return
            async with self.slots:
                doc = await asyncio.to_thread(document_from_bytes, data, safe_name(name), str(path))
                result = await self.pipeline.summarize(doc)
            self._finished(name, digest, result)
        except SkippedFile as exc:
            self._line(f"error: skipped {path}: {exc}", force=True)
        except OSError as exc:
            self._line(f"error: cannot read {path}: {exc.strerror or exc}", force=True)
        except Exception as exc:  # e.g. Redis unreachable: taken again at the next poll
            self.handled.pop(name, None)
            self._line(f"error: {name}: {type(exc).__name__}: {exc} (retried at the next poll)", force=True)
        finally:
            self.in_flight.pop(name, None)

    def _finished(self, name: str, digest: str, result: DocumentSummary) -> None:
        self.state[name] = digest
        write_top_file(self.out_dir, STATE_NAME, json.dumps(self.state, indent=1, sort_keys=True))
        write_report(self.out_dir)
        self.done += result.ok
        self.failed += not result.ok
        self._line(
            f"{name}: done -> {result.record.get('summary_file')}" if result.ok else f"error: {result.error}",
            force=True,
        )

    def _report_progress(self, force: bool = False) -> None:
        run = self.pipeline
        left = run.jobs_total - run.jobs_done
        rate = run.jobs_done / max(time.monotonic() - self.started, 1e-9)
        eta = f"{left / rate:.0f} s" if rate > 0 and left else "-"
        self._line(
            f"watch {self.inbox}: {self.done} documents done, {self.failed} failed, {len(self.in_flight)} in "
            f"flight; jobs {run.jobs_done}/{run.jobs_total}; {run.tokens} tokens; ETA {eta}",
            force,
        )

    def _line(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress is not None and (force or now - self.last_line >= PROGRESS_EVERY_S):
            print(printable(text), file=self.progress, flush=True)
            self.last_line = now


def _read_state(out_dir: Path) -> dict[str, str]:
    try:
        state = json.loads((out_dir / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return (
        {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(state, dict) else {}
    )
