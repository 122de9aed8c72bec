"""The engine core, as vLLM's EngineCore: one loop that steps ``LLMEngine`` while it has
work and, between steps, applies what its socket brings (new requests, aborts, a shutdown).
It is started two ways, with the same class and the same frames either way (the front
door's end is actors/engine_client.py):

- in a process of its own (``conveyor serve``): ``python -m conveyor.engine.engine_core <fd>``, so the
  front door's Python (asyncio, Redis, msgpack) never takes the GIL from the model's steps.
  Measured on the 2-core CPU (docs/performance.md "Front door cost"): with the model on a
  thread of the replica's process, decode steps took twice their offline time;
- on a thread of the front door's process (tests, ``conveyor demo``, ``--engine-process
  false``): ``serve(sock, engine)``.

Wire: frames (engine/core_frames.py) both ways, over a socketpair that only the
front door holds the other end of (never a network socket: pickle trusts its peer). The
first frame from the front door is the EngineConfig (or, on a thread with an engine already
built, nothing); the core answers CoreReady (or CoreFailed), then StepDone after each step.
"""

import logging
import os
import pickle
import select
import socket
import sys
from dataclasses import dataclass, field

from conveyor.engine.child_env import die_with_parent, ignore_stop_signals
from conveyor.engine.config import EngineConfig
from conveyor.engine.core_frames import encode_frame, receive_frame
from conveyor.engine.core_request import EngineCoreRequest
from conveyor.engine.outputs import RequestOutput

log = logging.getLogger("conveyor.core")
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
class AddRequest:
    request: EngineCoreRequest


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
        if isinstance(message, AddRequest):
            seq = message.request.to_sequence()
            self.engine.inputs.adopt_grammar(seq)
            self.engine.add_sequence(seq)
        elif isinstance(message, AbortRequest):
            self.engine.abort_request(message.request_id)
        elif isinstance(message, Shutdown):
            self.running = False
        else:
            raise TypeError(f"engine core: unexpected message {type(message).__name__}")

    def _check_ranks(self) -> None:
        workers = self.engine.runner.workers
        if workers is not None:
            workers.check_alive()  # RankFailed ends the core; the front door sees its socket close


def facts_of(engine) -> CoreFacts:
    return CoreFacts(
        model_name=engine.spec.name,
        tokenizer_dir=str(engine.tokenizer_dir),
        vocab_size=engine.spec.hf_config.vocab_size,
        max_model_len=engine.max_model_len,
        max_pool_tokens=engine.inputs.max_pool_tokens,
        eos_token_ids=frozenset(engine.spec.eos_token_ids),
        max_num_seqs=engine.config.max_num_seqs,
    )


def serve(sock: socket.socket, engine=None) -> int:
    """The core's whole life on ``sock``: build the engine from the first frame's config
    (unless the caller gives one it owns), report it, run until Shutdown or until the front
    door goes away, then close the engine it built (and its tensor-parallel ranks)."""
    with sock:
        if engine is not None:
            return _run(engine, sock)
        engine = _build_engine(sock, receive_frame(sock))
        if engine is None:
            return 1
        try:
            return _run(engine, sock)
        finally:
            engine.close()


def _run(engine, sock: socket.socket) -> int:
    try:
        sock.sendall(encode_frame(CoreReady(facts_of(engine))))
        EngineCore(engine, sock).run()
    except (EOFError, OSError):  # closed, or reset with unread frames (ECONNRESET, EPIPE)
        log.info("engine core: the front door went away; stopping")
    return 0


def _build_engine(sock: socket.socket, config: EngineConfig):
    from conveyor.engine.llm_engine import LLMEngine

    try:
        return LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - the front door raises it as its own
        sock.sendall(encode_frame(CoreFailed(portable(exc))))
        return None


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (not every exception's __init__ allows it), else a
    ModelLoadError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip
        from conveyor.engine.errors import ModelLoadError

        return ModelLoadError(f"{type(exc).__name__}: {exc}")


def main() -> int:
    die_with_parent()
    ignore_stop_signals()
    logging.basicConfig(
        level=os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    return serve(sock)


if __name__ == "__main__":
    from conveyor.engine.engine_core import (
        main as module_main,  # messages pickle as engine.engine_core's, not __main__'s
    )

    sys.exit(module_main())
