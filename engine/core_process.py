"""The engine core in a process of its own, as vLLM's EngineCore: the replica's front door
(asyncio, Redis, msgpack: actors/) lives in another process and talks to this one over a
socket, so its Python never takes the GIL from under the model's steps.

Measured on the 2-core CPU (docs/performance.md "Front door cost"): with the model on a
thread of the replica's process, decode steps took twice their offline time, a quarter of
the model thread's samples waiting to get the GIL back after a kernel while the event loop
held it. Here the core runs exactly the offline loop (``LLMEngine.step``) and, between
steps, takes what the socket brings: new sequences, aborts, a shutdown.

    python -m engine.core_process <fd>   (started by actors/engine_core.py)

Wire: frames of a 4-byte length and a pickle, both ways, over a socketpair that only the
replica holds the other end of (never a network socket: pickle trusts its peer). The first
frame from the front door is the EngineConfig; the core answers CoreReady (or CoreFailed),
then StepDone after each step.
"""
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sequence import Sequence

log = logging.getLogger("conveyor.core")
FRAME_HEADER = struct.Struct("!I")
IDLE_WATCH_S = 0.5  # an idle core still looks at its tensor-parallel ranks this often


# ---- messages -------------------------------------------------------------------------
@dataclass(frozen=True)
class CoreFacts:
    """What the front door needs to know of the engine the core built."""
    model_name: str
    tokenizer_dir: str
    vocab_size: int
    max_model_len: int
    max_pool_tokens: int
    eos_token_ids: frozenset
    max_num_seqs: int


@dataclass
class CoreReady:
    facts: CoreFacts


@dataclass
class CoreFailed:
    error: BaseException


@dataclass
class AddSequence:
    seq: Sequence
    prompt: str | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class StepDone:
    outputs: list[RequestOutput]
    stats: dict = field(default_factory=dict)


# ---- framing --------------------------------------------------------------------------
def encode_frame(message) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(data)) + data


def receive_frame(sock: socket.socket):
    """The next message; EOFError when the peer closed its end."""
    (length,) = FRAME_HEADER.unpack(_receive_exactly(sock, FRAME_HEADER.size))
    return pickle.loads(_receive_exactly(sock, length))


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the front door closed the engine core's socket")
        got += n
    return bytes(buffer)


# ---- the core's loop ------------------------------------------------------------------
class EngineCore:
    """Steps the engine while it has work; applies the front door's messages between steps."""

    def __init__(self, engine, sock: socket.socket):
        self.engine = engine
        self.sock = sock
        self.running = True

    def run(self) -> None:
        while self.running:
            wait = self.engine.seconds_until_ready() if self.engine.has_unfinished_requests() else IDLE_WATCH_S
            if wait > 0:
                self._take_messages(timeout=min(wait, IDLE_WATCH_S))
                self._check_ranks()
                continue
            self._check_ranks()
            outputs = self.engine.step()  # every step is reported: its stats feed the replica's gauges
            self.sock.sendall(encode_frame(StepDone(outputs, self.engine.stats())))
            self._take_messages(timeout=0)

    def _take_messages(self, timeout: float) -> None:
        """Everything the socket holds now (waiting at most ``timeout`` for the first)."""
        while self.running and select.select([self.sock], [], [], timeout)[0]:
            self._apply(receive_frame(self.sock))
            timeout = 0

    def _apply(self, message) -> None:
        if isinstance(message, AddSequence):
            self.engine.inputs.adopt_grammar(message.seq)
            self.engine.add_sequence(message.seq, message.prompt)
        elif isinstance(message, AbortRequest):
            self.engine.abort_request(message.request_id)
        elif isinstance(message, Shutdown):
            self.running = False
        else:
            raise TypeError(f"engine core: unexpected message {type(message).__name__}")

    def _check_ranks(self) -> None:
        workers = self.engine.runner.workers
        if workers is not None:
            workers.check_alive()  # RankFailed ends this process; the front door sees it and stops


def facts_of(engine) -> CoreFacts:
    return CoreFacts(model_name=engine.spec.name, tokenizer_dir=str(engine.tokenizer_dir),
                     vocab_size=engine.spec.hf_config.vocab_size, max_model_len=engine.max_model_len,
                     max_pool_tokens=engine.inputs.max_pool_tokens, eos_token_ids=frozenset(engine.spec.eos_token_ids),
                     max_num_seqs=engine.config.max_num_seqs)


def serve(sock: socket.socket) -> int:
    from engine.llm_engine import LLMEngine
    config: EngineConfig = receive_frame(sock)
    try:
        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - the front door raises it as its own
        sock.sendall(encode_frame(CoreFailed(portable(exc))))
        return 1
    try:
        sock.sendall(encode_frame(CoreReady(facts_of(engine))))
        EngineCore(engine, sock).run()
    except (EOFError, OSError):  # closed, or reset with unread frames (ECONNRESET, EPIPE)
        log.info("engine core: the front door went away; stopping")
    finally:
        engine.close()
    return 0


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (not every exception's __init__ allows it), else a
    ModelLoadError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip
        from engine.errors import ModelLoadError
        return ModelLoadError(f"{type(exc).__name__}: {exc}")


def ignore_stop_signals() -> None:
    """A Ctrl-C (the whole process group) or a SIGTERM to every process of a container must
    not end the core or its tensor-parallel ranks under a front door that is still
    draining: the front door ends them (Shutdown, or its socket closing; the ranks follow
    rank 0). A Python handler, not SIG_IGN, which exec'd children would inherit."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)


def _die_with_parent() -> None:
    """A front door killed with SIGKILL leaves no core computing for nobody (Linux)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def main() -> int:
    _die_with_parent()
    ignore_stop_signals()
    logging.basicConfig(level=os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    return serve(sock)


if __name__ == "__main__":
    from engine.core_process import main as module_main  # messages pickle as engine.core_process's, not __main__'s
    sys.exit(module_main())
