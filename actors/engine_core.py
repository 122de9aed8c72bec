"""The engine core's process as the front door sees it (engine/core_process.py is the other
side): ``EngineCoreProcess`` starts it and waits for the model to load; ``CoreProcessActor``
is the scheduler role of a replica whose engine runs there. It owns the jobs in the engine
(JobsInEngine) and forwards new jobs and aborts to the core; a reader task publishes each
StepDone the core sends. The core dying ends the actor, so the replica stops (exit 1) and
another replica reclaims its jobs once their leases lapse."""
import asyncio
import contextlib
import logging
import pickle
import socket
import subprocess
import sys

from actors.base import drain
from actors.jobs_in_engine import JobsInEngine
from actors.metrics import ReplicaMetrics
from engine.child_env import child_env
from engine.config import EngineConfig
from engine.core_process import (FRAME_HEADER, AbortRequest, AddSequence, CoreFailed, CoreFacts, Shutdown,
                                 StepDone, encode_frame, receive_frame)
from engine.sequence import Sequence

log = logging.getLogger(__name__)
SHUTDOWN_WAIT_S = 10.0
DEADLINE_POLL_S = 0.5  # deadlines of running jobs are checked at least this often


class CoreDied(RuntimeError):
    pass


class EngineCoreProcess:
    """Starts ``python -m engine.core_process`` and waits until its engine is built (the
    model's load errors are raised here, as LLMEngine's own). Offers what a replica needs of
    an engine: ``facts``, ``tokenizer``, ``own_input_processor()``, ``close()``. This module
    imports nothing heavy, so the core starts before the front door imports torch and
    transformers (seconds on a small CPU), which it does while the core loads the model."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.sock, child = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "engine.core_process", str(child.fileno())],
                                        pass_fds=(child.fileno(),), env=child_env())
        child.close()
        self.writer: asyncio.StreamWriter | None = None  # the socket's once the event loop reads it
        self.shutdown_sent = False
        try:
            self.sock.sendall(encode_frame(config))
            from transformers import AutoTokenizer  # meanwhile: the front door's own heavy imports
            import engine.input_processor  # noqa: F401
            self.facts: CoreFacts = self._wait_until_ready()
            self.tokenizer = AutoTokenizer.from_pretrained(self.facts.tokenizer_dir)
        except BaseException:
            self.close()  # no core left running for a front door that will not serve
            raise
        log.info("engine core: pid %d, model %s", self.process.pid, self.facts.model_name)

    @property
    def pid(self) -> int:
        return self.process.pid

    def own_input_processor(self) -> "InputProcessor":
        """Ingest's: its grammars serialized where they are compiled (its worker thread), not on the loop."""
        from transformers import AutoTokenizer
        from engine.input_processor import InputProcessor
        facts = self.facts
        return InputProcessor(AutoTokenizer.from_pretrained(facts.tokenizer_dir), facts.vocab_size,
                              facts.max_model_len, facts.max_pool_tokens, facts.eos_token_ids,
                              serialize_grammars=True)

    async def open_reader(self) -> asyncio.StreamReader:
        """From now on the event loop owns the socket: frames go out through ``send``."""
        self.sock.setblocking(False)
        reader, self.writer = await asyncio.open_connection(sock=self.sock)
        return reader

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
        code = self.process.poll()
        return f"engine core (pid {self.process.pid}) " + ("is still running" if code is None
                                                            else f"exited with code {code}")

    def close(self) -> None:
        """Before the event loop reads the socket: asks the core to stop, waits for it
        (kills it after SHUTDOWN_WAIT_S). Once it does, use ``aclose``."""
        assert self.writer is None, "the event loop owns the socket: await aclose()"
        if self.process.poll() is None:
            with contextlib.suppress(OSError):  # it is already going
                self.request_shutdown()
            self._wait_or_kill()
        self.sock.close()

    async def aclose(self) -> None:
        """The same from the event loop, which keeps running meanwhile, so frames still
        queued ahead of the Shutdown (a large job's) reach the core."""
        if self.writer is None:
            return await asyncio.to_thread(self.close)
        if self.process.poll() is None:
            self.request_shutdown()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(self.writer.drain(), SHUTDOWN_WAIT_S)
            await asyncio.to_thread(self._wait_or_kill)
        self.writer.close()

    def _wait_or_kill(self) -> None:
        try:
            self.process.wait(SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _wait_until_ready(self) -> CoreFacts:
        try:
            reply = receive_frame(self.sock)
        except EOFError:
            self.process.wait()
            raise CoreDied(f"{self.exit_description()} before its engine was built") from None
        if isinstance(reply, CoreFailed):
            self.process.wait()
            raise reply.error
        return reply.facts


class CoreProcessActor(JobsInEngine):
    def __init__(self, core: EngineCoreProcess, publisher, metrics: ReplicaMetrics, job_hooks: tuple = ()):
        super().__init__(publisher, metrics, job_hooks)
        self.core = core

    async def run(self) -> None:
        reader = await self.core.open_reader()
        halves = [asyncio.ensure_future(self._forward_mail()), asyncio.ensure_future(self._publish_steps(reader))]
        try:
            done, _ = await asyncio.wait(halves, return_when=asyncio.FIRST_EXCEPTION)
            for half in done:
                half.result()  # the first one's exception ends the actor
        finally:
            for half in halves:
                half.cancel()  # neither half outlives the other

    async def stop(self) -> None:
        await super().stop()
        if self.core.writer is not None:
            self.core.request_shutdown()

    async def _forward_mail(self) -> None:
        while not self.stopped:
            await self._wait_for_mail(DEADLINE_POLL_S)
            for message in drain(self.mailbox):
                self._apply(message)
            self._expire_deadlines()
            try:
                await self.core.drain()
            except ConnectionError:
                raise await self._core_died() from None

    async def _publish_steps(self, reader: asyncio.StreamReader) -> None:
        while not self.stopped:
            try:
                (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
                done: StepDone = pickle.loads(await reader.readexactly(length))
            except (asyncio.IncompleteReadError, ConnectionError):
                raise await self._core_died() from None
            self.steps += 1
            await self.publish(done.outputs, done.stats)

    async def _core_died(self) -> CoreDied:
        """Why the socket broke, once the core's exit code is known (or 5 s have passed)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.core.process.wait, 5.0)
        return CoreDied(self.core.exit_description())

    def add_to_engine(self, seq: Sequence) -> None:
        self.core.send(AddSequence(seq))

    def abort_in_engine(self, job_id: str) -> None:
        self.core.send(AbortRequest(job_id))
