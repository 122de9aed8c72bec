"""The front door's end of the engine core's socket (engine/engine_core.py is the other
end), as vLLM's EngineCoreClient. The core starts one of two ways, and nothing after the
start knows which: ``in_child_process(config)`` (``conveyor serve``) or ``on_thread(engine
or config)`` (tests, ``conveyor demo``, ``--engine-process false``). Either way the same
frames cross the same kind of socket and the same ``EngineCore`` loop steps the engine.

This module imports nothing heavy at module level, so a child core starts before the front
door imports torch and transformers (seconds on a small CPU), which it does while the core
loads the model."""

import asyncio
import contextlib
import importlib
import logging
import socket
import subprocess
import threading
from typing import TYPE_CHECKING

from conveyor.engine.child_env import module_command
from conveyor.engine.core_frames import encode_frame, frame_reader, receive_frame
from conveyor.engine.engine_core import CoreFacts, CoreFailed, Shutdown

if TYPE_CHECKING:  # the front door imports the engine's heavy modules only once the core is started
    from conveyor.engine.input_processor import InputProcessor

log = logging.getLogger(__name__)
SHUTDOWN_WAIT_S = 10.0


class CoreDied(RuntimeError):
    pass


class ChildProcessStart:
    """The core in ``python -m conveyor.engine.engine_core <fd>``."""

    def __init__(self, core_end: socket.socket):
        self.process = subprocess.Popen(
            [*module_command("conveyor.engine.engine_core"), str(core_end.fileno())],
            pass_fds=(core_end.fileno(),),
        )
        core_end.close()
        self.pid = self.process.pid

    def exit_description(self) -> str:
        code = self.process.poll()
        return f"engine core (pid {self.pid}) " + ("is still running" if code is None else f"exited with code {code}")

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class ThreadStart:
    """The core on a daemon thread of this process, over an engine it builds from the first
    frame's config or one the caller built (and closes)."""

    def __init__(self, core_end: socket.socket, engine=None):
        # imported here, before the thread starts: transformers' lazy modules are not safe to
        # import from two threads at once (seen: "cannot import name AutoTokenizer")
        for module in ("transformers", "conveyor.engine.input_processor", "conveyor.engine.llm_engine"):
            importlib.import_module(module)
        importlib.import_module("transformers").AutoTokenizer  # noqa: B018 - resolves the lazy name here
        from conveyor.engine.engine_core import serve

        self.pid = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._serve, args=(serve, core_end, engine), name="conveyor-engine-core", daemon=True
        )
        self.thread.start()

    def _serve(self, serve, core_end: socket.socket, engine) -> None:
        try:
            serve(core_end, engine)
        except BaseException as exc:  # noqa: BLE001 - reported by exit_description; the socket closed with it
            self.error = exc
            log.critical("engine core thread crashed", exc_info=exc)

    def exit_description(self) -> str:
        if self.thread.is_alive():
            return "engine core (thread) is still running"
        return f"engine core (thread) ended: {self.error!r}" if self.error else "engine core (thread) ended"

    def running(self) -> bool:
        return self.thread.is_alive()

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)

    def kill(self) -> None:
        log.warning("engine core thread still busy after %.0f s; leaving it (a daemon thread)", SHUTDOWN_WAIT_S)


class EngineCoreClient:
    """Waits until the core's engine is built (the model's load errors are raised here, as
    LLMEngine's own). Offers what a replica needs of an engine: ``facts``, ``tokenizer``,
    ``own_input_processor()``, then the socket's two directions and ``aclose()``."""

    def __init__(self, start_core, config=None):
        """``start_core(core_end)`` starts the core on its end of a new socketpair; ``config``
        is the first frame (None: the core has its engine already)."""
        self.sock, core_end = socket.socketpair()
        self.start = start_core(core_end)
        self.reader: asyncio.StreamReader | None = None  # the socket's once the event loop reads it
        self.writer: asyncio.StreamWriter | None = None
        self.shutdown_sent = False
        try:
            if config is not None:
                self.sock.sendall(encode_frame(config))
            from transformers import AutoTokenizer  # meanwhile: the front door's own heavy imports

            import conveyor.engine.input_processor  # noqa: F401

            self.facts: CoreFacts = self._wait_until_ready()
            self.tokenizer = AutoTokenizer.from_pretrained(self.facts.tokenizer_dir)
        except BaseException:
            self.close()  # no core left running for a front door that will not serve
            raise
        log.info(
            "engine core: %s, model %s",
            f"pid {self.start.pid}" if self.start.pid else "on a thread",
            self.facts.model_name,
        )

    @classmethod
    def in_child_process(cls, config) -> "EngineCoreClient":
        return cls(ChildProcessStart, config)

    @classmethod
    def on_thread(cls, engine_or_config) -> "EngineCoreClient":
        from conveyor.engine.config import EngineConfig

        if isinstance(engine_or_config, EngineConfig):
            return cls(ThreadStart, engine_or_config)
        return cls(lambda core_end: ThreadStart(core_end, engine_or_config))

    def own_input_processor(self) -> "InputProcessor":
        """Ingest's: its grammars serialized where they are compiled (its worker thread), not on the loop."""
        from transformers import AutoTokenizer

        from conveyor.engine.input_processor import InputProcessor

        facts = self.facts
        return InputProcessor(
            AutoTokenizer.from_pretrained(facts.tokenizer_dir),
            facts.vocab_size,
            facts.max_model_len,
            facts.max_pool_tokens,
            facts.eos_token_ids,
            serialize_grammars=True,
        )

    async def open_stream(self) -> None:
        """From now on the event loop owns the socket: frames go out through ``send`` and
        come in through ``receive``."""
        self.sock.setblocking(False)
        self.reader, self.writer = await asyncio.open_connection(sock=self.sock)

    async def receive(self):
        """The core's next message (engine/core_frames.py's reader over the stream);
        asyncio.IncompleteReadError or ConnectionError when the core's end is gone."""
        reads = frame_reader()
        size = next(reads)
        try:
            while True:
                size = reads.send(await self.reader.readexactly(size))
        except StopIteration as done:
            return done.value

    def send(self, message) -> None:
        self.writer.write(encode_frame(message))

    async def drain(self) -> None:
        await self.writer.drain()

    def request_shutdown(self) -> None:
        """Once: the core stops after its current step (its outputs could publish nothing now)."""
        if self.shutdown_sent:
            return
        self.shutdown_sent = True
        frame = encode_frame(Shutdown())
        if self.writer is not None:
            self.writer.write(frame)
        else:
            self.sock.sendall(frame)

    def exit_description(self) -> str:
        return self.start.exit_description()

    async def wait_for_exit(self, timeout: float) -> None:
        await asyncio.to_thread(self.start.wait, timeout)

    def close(self) -> None:
        """Before the event loop reads the socket: asks the core to stop, waits for it
        (kills a child process after SHUTDOWN_WAIT_S). Once it does, use ``aclose``."""
        assert self.writer is None, "the event loop owns the socket: await aclose()"
        if self.start.running():
            with contextlib.suppress(OSError):  # it is already going
                self.request_shutdown()
            self._wait_or_kill()
        self.sock.close()

    async def aclose(self) -> None:
        """The same from the event loop, which keeps running meanwhile, so frames still
        queued ahead of the Shutdown (a large job's) reach the core."""
        if self.writer is None:
            return await asyncio.to_thread(self.close)
        if self.start.running():
            self.request_shutdown()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(self.writer.drain(), SHUTDOWN_WAIT_S)
            await asyncio.to_thread(self._wait_or_kill)
        self.writer.close()

    def _wait_or_kill(self) -> None:
        self.start.wait(SHUTDOWN_WAIT_S)
        if self.start.running():
            self.start.kill()

    def _wait_until_ready(self) -> CoreFacts:
        try:
            reply = receive_frame(self.sock)
        except EOFError:
            self.start.wait(SHUTDOWN_WAIT_S)
            raise CoreDied(f"{self.exit_description()} before its engine was built") from None
        if isinstance(reply, CoreFailed):
            self.start.wait(SHUTDOWN_WAIT_S)
            raise reply.error
        return reply.facts
