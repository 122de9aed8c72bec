"""Compiles producers' grammars in a child process under hard limits, so a constraint
crafted to blow up (a "grammar bomb": a few hundred bytes of nested regex repetitions in a
JSON schema's patterns) costs its own request a bounded amount of memory and time, and
never the replica that takes it (nor every replica it would be re-delivered to).

xgrammar compiles in C++ and cannot be interrupted; only a process can be bounded. So one
worker process per `GrammarCompiler` compiles, one grammar at a time, and answers with the
compiled grammar's JSON (xgrammar's own serialization: what crosses to the engine core
anyway). Its bounds, per compile (`CompileLimits`, read from the environment):

  memory   RLIMIT_AS: the worker's address space once started (Python, xgrammar and the
           torch it imports, the tokenizer) plus ``memory_bytes``
           (CONVEYOR_GRAMMAR_MEMORY_MB, default 640)
  time     ``wall_s`` of wall clock, then SIGKILL (CONVEYOR_GRAMMAR_TIMEOUT_S, default 8),
           with RLIMIT_CPU (``cpu_s`` per compile, xgrammar's threads together) behind it
  size     the compiled grammar's JSON, at most ``max_grammar_bytes``
           (CONVEYOR_GRAMMAR_MAX_MB, default 32): what the engine core rebuilds it from
           (in up to about 5 times as much memory) and what the caches hold

A compile over a bound raises `CompileRefused` naming the limit: its request's error, and
only its own. The worker is then replaced (started at once, so the next compile seldom
waits for it); one whose heap kept what a compile freed is replaced as well. The first
worker starts on the first compile (about 2 s: xgrammar imports torch); a worker ends
when its stdin closes (this process gone) or on `close()`.

Protocol: msgpack maps over the worker's stdin and stdout, one request, one reply; the
first request carries the tokenizer (xgrammar's TokenizerInfo as JSON) and the limits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import msgpack

log = logging.getLogger(__name__)
CHILD_MAIN = "from conveyor.engine.grammar_worker import main; main()"
XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[15:49:50] /project/cpp/x.cc:123: "
# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as [^"\\\r\n]
# (no escapes): that lets raw control characters through, which JSON forbids. Such rules get
# JSON's class of characters that need no escape instead.
LENGTH_BOUNDED_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\]")
MiB = 1 << 20
START_TIMEOUT_S = 120.0  # the worker's imports (torch, through xgrammar) on a loaded box
RETIRE_GROWTH = 4  # a worker whose idle address space grew by more than its budget / this is replaced
STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class CompileLimits:
    memory_bytes: int = 640 * MiB
    wall_s: float = 8.0
    cpu_s: int = 30
    max_grammar_bytes: int = 32 * MiB

    @classmethod
    def from_env(cls, environ=None) -> CompileLimits:
        environ = os.environ if environ is None else environ
        default = cls()

        def number(name: str, value: float) -> float:
            """The variable's value; where it is not a positive number, the default (logged)."""
            text = environ.get(name)
            try:
                given = float(text) if text else value
            except ValueError:
                given = 0.0
            if not 0 < given < float("inf"):
                log.warning("%s must be a positive number, got %r: using %g", name, text, value)
                return value
            return given

        return cls(
            memory_bytes=int(number("CONVEYOR_GRAMMAR_MEMORY_MB", default.memory_bytes / MiB) * MiB),
            wall_s=number("CONVEYOR_GRAMMAR_TIMEOUT_S", default.wall_s),
            cpu_s=default.cpu_s,
            max_grammar_bytes=int(number("CONVEYOR_GRAMMAR_MAX_MB", default.max_grammar_bytes / MiB) * MiB),
        )


class CompileRefused(Exception):
    """A grammar that was not compiled: over a limit, or (``invalid``) xgrammar's own error."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.message = message
        self.invalid = invalid


class GrammarWorker:
    """The parent's end: one worker process, one compile at a time."""

    def __init__(self, tokenizer_info_json: str, limits: CompileLimits | None = None):
        self.tokenizer_info_json = tokenizer_info_json
        self.limits = limits or CompileLimits.from_env()
        self.process: subprocess.Popen | None = None
        self.unpacker: msgpack.Unpacker | None = None
        self.ready = False  # it answered its first message (the tokenizer and the limits)
        self.starts = 0  # workers started so far
        self._finalizer = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def compile(self, source: str, text: str, any_whitespace: bool) -> tuple[str, int]:
        """(the compiled grammar's JSON, xgrammar's count of its bytes); CompileRefused."""
        with self._lock:
            self._ready()
            request = {"source": source, "text": text, "any_whitespace": any_whitespace}
            try:
                reply = self._ask(request, self.limits.wall_s)
            except CompileRefused:
                self._replace()
                raise
            if reply.get("retire"):
                self._replace()
            if "error" in reply:
                raise CompileRefused(str(reply["error"]), invalid=bool(reply.get("invalid")))
            return reply["serialized"], int(reply["memory"])

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.process = self.unpacker = self._finalizer = None
        self.ready = False

    # ---- the worker's life -----------------------------------------------------------
    def _replace(self) -> None:
        """Stop this worker and start the next at once: it imports while nothing waits for it."""
        self.close()
        try:
            self._spawn()
        except OSError:
            self.close()  # tried again on the next compile

    def _spawn(self) -> None:
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}  # few malloc arenas: address space is what is bounded
        command = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c", CHILD_MAIN]
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True, bufsize=0
        )
        os.set_blocking(process.stdin.fileno(), False)  # writes wait in _send, within a deadline
        self.process = process
        self._finalizer = weakref.finalize(self, _stop, process)
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=self.limits.max_grammar_bytes + MiB)
        self.starts += 1

    def _ready(self) -> None:
        """A worker that has its tokenizer: this one, else a new one (the first, or after
        one ended: killed from outside, or retired itself)."""
        if self.process is not None and self.process.poll() is not None:
            self.close()
        if self.process is None:
            try:
                self._spawn()
            except OSError as exc:
                self.close()
                raise CompileRefused(f"the grammar compiler process could not start ({exc})") from None
        if self.ready:
            return
        limits = self.limits
        hello = {
            "tokenizer_info": self.tokenizer_info_json,
            "memory_bytes": limits.memory_bytes,
            "cpu_s": limits.cpu_s,
            "max_grammar_bytes": limits.max_grammar_bytes,
        }
        try:
            reply = self._ask(hello, START_TIMEOUT_S, starting=True)
        except CompileRefused as exc:
            self.close()
            raise CompileRefused(f"the grammar compiler process could not start ({exc.message})") from None
        if not reply.get("ready"):
            self.close()
            raise CompileRefused(f"the grammar compiler process could not start ({reply.get('error', reply)})")
        self.ready = True

    def _ask(self, message: dict, timeout_s: float, starting: bool = False) -> dict:
        """Send ``message`` and read the reply, both within ``timeout_s``; CompileRefused
        naming the limit when the worker overruns it (then it is killed) or dies."""
        ends = time.monotonic() + timeout_s
        data = memoryview(msgpack.packb(message, use_bin_type=True))
        fd_in, fd_out = self.process.stdin.fileno(), self.process.stdout.fileno()
        while True:
            for reply in self.unpacker:
                if isinstance(reply, dict):
                    return reply
                raise CompileRefused("the grammar compiler process answered nonsense")
            left = ends - time.monotonic()
            if left <= 0:
                _stop(self.process)
                if starting:
                    raise CompileRefused(f"it did not start within {timeout_s:g} s")
                raise CompileRefused(f"compiling it took longer than the limit of {timeout_s:g} s (stopped)")
            readable, writable, _ = select.select([fd_out], [fd_in] if data else [], [], left)
            if writable:
                try:
                    data = data[os.write(fd_in, data) :]
                except BlockingIOError:
                    pass
                except OSError:  # it died: its stdout ends and tells how
                    data = data[:0]
            if not readable:
                continue
            try:
                chunk = os.read(fd_out, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                raise CompileRefused(self._death(starting))
            try:
                self.unpacker.feed(chunk)
            except msgpack.BufferFull:
                _stop(self.process)
                raise CompileRefused(
                    f"its compiled grammar is over the limit of {self.limits.max_grammar_bytes / MiB:g} MiB"
                ) from None

    def _death(self, starting: bool) -> str:
        """Why the worker's stdout ended, for its request's error."""
        try:
            code = self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            _stop(self.process)
            code = self.process.returncode
        how = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exit status {code}"
        if starting:
            return how
        if code == -signal.SIGXCPU:
            return f"compiling it needed more than the limit of {self.limits.cpu_s} s of CPU (stopped)"
        return (
            f"compiling it stopped the grammar compiler process ({how}): it needs more than the limits of "
            f"{self.limits.memory_bytes / MiB:g} MiB of memory and {self.limits.wall_s:g} s"
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _stop(process: subprocess.Popen) -> None:
    """End a worker now (SIGKILL: it may be deep in a compile) and reap it."""
    if process.poll() is None:
        try:
            process.kill()
        except ProcessLookupError:
            pass
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()
        except OSError:
            pass
    try:
        process.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


# --------------------------------------------------------------------------- the worker's side


def main() -> None:
    from conveyor.engine.child_env import ignore_stop_signals

    ignore_stop_signals()  # its parent ends it (stdin closed), not a Ctrl-C to the process group
    import xgrammar  # noqa: F401 - the slow part of its start (torch), before its parent asks for anything

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the protocol's stream
    unpacker = msgpack.Unpacker(_Available(stdin), raw=False, max_buffer_size=64 * MiB)
    worker = None
    for message in unpacker:
        try:
            if worker is None:
                worker = _Worker(message)
                reply = {"ready": True}
            else:
                reply = worker.compile(message)
        except MemoryError:
            budget = f"{worker.memory_bytes / MiB:g} MiB" if worker is not None else "its memory"
            reply = {"error": f"compiling it needed more than the limit of {budget} of memory (stopped)", "retire": 1}
        except Exception as exc:  # noqa: BLE001 - a startup failure, told to the parent
            reply = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "retire": 1}
        try:
            stdout.write(msgpack.packb(reply, use_bin_type=True))
            stdout.flush()
        except MemoryError:
            os._exit(3)  # no room even to answer: the parent reports the limit
        if reply.get("retire"):
            return


class _Available:
    """A stream whose read returns what has arrived (msgpack's reader would wait for a full buffer)."""

    def __init__(self, stream):
        self.read = stream.read1


class _Worker:
    def __init__(self, hello: dict):
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.deserialize_json(hello["tokenizer_info"])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.memory_bytes = int(hello["memory_bytes"])
        self.cpu_s = int(hello["cpu_s"])
        self.max_grammar_bytes = int(hello["max_grammar_bytes"])
        self.trim = _malloc_trim()
        self.trim()
        # the bound: what it takes now (interpreter, libraries, tokenizer) plus the budget
        self.base = _address_space()
        _lower(resource.RLIMIT_AS, self.base + self.memory_bytes)

    def compile(self, request: dict) -> dict:
        used = int(sum(resource.getrusage(resource.RUSAGE_SELF)[:2])) + 1
        _lower(resource.RLIMIT_CPU, used + self.cpu_s)
        try:
            compiled = compile_in_process(self.compiler, request["source"], request["text"], request["any_whitespace"])
            memory = compiled.memory_size_bytes
            serialized = compiled.serialize_json()
            del compiled
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError with its own text
            text = reason_of(exc)
            if "bad_alloc" in text or "MemoryError" in text or "Cannot allocate" in text:
                raise MemoryError from None
            return {"error": text, "invalid": 1, **self._health()}
        if len(serialized) > self.max_grammar_bytes:
            size = len(serialized)
            del serialized
            return {
                "error": f"its compiled grammar is {size / MiB:.1f} MiB, over the limit of "
                f"{self.max_grammar_bytes / MiB:g} MiB",
                **self._health(),
            }
        return {"serialized": serialized, "memory": memory, **self._health()}

    def _health(self) -> dict:
        """Retire a worker whose heap kept what it freed (the next compile would have less room)."""
        self.trim()
        return {"retire": 1} if _address_space() - self.base > self.memory_bytes / RETIRE_GROWTH else {}


def compile_in_process(compiler, source: str, text: str, any_whitespace: bool):
    """xgrammar's compile of a constraint key's (json | regex | grammar, its text, any
    whitespace): unbounded, so only the worker calls it, under its limits."""
    import xgrammar as xgr

    if source == "json":
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        return compiler.compile_grammar(_json_strings_fixed(grammar))
    if source == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def _json_strings_fixed(grammar):
    """The grammar (or its EBNF text, fixed) with no raw control characters in its strings."""
    text = str(grammar)
    return text.replace(*LENGTH_BOUNDED_CHARS) if LENGTH_BOUNDED_CHARS[0] in text else grammar


def reason_of(exc: Exception) -> str:
    """xgrammar's message: its first line, without the "[time] file:line: " prefix."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return XGRAMMAR_PREFIX.sub("", lines[0])[:500]


def _lower(which: int, soft: int) -> None:
    """Set ``which``'s soft limit to ``soft``, or to its hard limit where that is lower."""
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _address_space() -> int:
    """This process's address space (Linux; elsewhere the peak resident size, a lower bound)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _malloc_trim():
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)
