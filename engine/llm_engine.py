"""The incremental engine: add / abort requests, ``step()``, and their outputs.

One step is schedule -> run -> postprocess (append tokens, detokenize, then end the
sequences a stop condition ended, checked in engine/finishing.py's order). A step that
verified draft tokens (engine/spec_decode/) may give a sequence several tokens: each is
appended and checked as if it were a step's only token, and those after a stop are
dropped. It is the one engine both ways Conveyor runs: the offline API (engine/llm.py)
steps it in the caller's thread, and a replica's engine core (engine/engine_core.py) steps
it in its own process or thread, fed by the front door's frames.
"""

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from transformers import AutoTokenizer

from conveyor.engine.config import EngineConfig
from conveyor.engine.errors import InvalidRequest, ModelLoadError
from conveyor.engine.finishing import StopRules
from conveyor.engine.input_processor import InputProcessor
from conveyor.engine.lora.adapter import check_adapter
from conveyor.engine.model_runner import ModelRunner
from conveyor.engine.models.loader import load_spec, sampling_defaults
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.parallel_sampling import ParallelSampling
from conveyor.engine.plan import StepPlan, StepResult
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence
from conveyor.engine.spec_decode.drafter import spec_stats

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.spec = load_spec(config.model)
        self.max_model_len = resolve_max_model_len(config, self.spec.max_context)
        self.tokenizer_dir = resolve_tokenizer_dir(config.tokenizer, self.spec.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        # what a request's unset sampling fields take (the model's generation config, by default)
        self.sampling_defaults = sampling_defaults(config.model, config.generation_config, self.spec.model_dir)
        log.info("%s", self.sampling_defaults.describe())
        self.runner = ModelRunner(config, self.spec, self.max_model_len)
        self.stop_rules = StopRules(self.spec.eos_token_ids, self.max_model_len)
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.stop_rules)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.spec.hf_config.vocab_size,
            self.max_model_len,
            self.runner.num_blocks * config.block_size,
            self.spec.eos_token_ids,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.samples = ParallelSampling(share_prefix=config.enable_prefix_caching)  # n > 1 requests
        self._ended: list[Sequence] = []  # aborted or failed outside a step: reported next step
        self._in_flight: deque[tuple[StepPlan, Future]] = deque()  # overlapped steps, oldest first
        self._model_thread: ThreadPoolExecutor | None = None
        self._pipelined: deque[StepPlan] = deque()  # pipeline parallel: steps launched, oldest first
        self.max_steps_in_flight = 0
        self.num_steps = 0  # plans that scheduled work

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt=None,
        params: SamplingParams | None = None,
        priority_class: str = "interactive",
        priority: int = 0,
        arrival_time: float | None = None,
        messages: list[dict] | None = None,
        lora_request=None,
    ) -> Sequence:
        """``prompt``: text or token ids; or ``messages`` (chat). Raises InvalidRequest."""
        seq = self.make_sequence(
            request_id, prompt, params, priority_class, priority, arrival_time, messages, lora_request
        )
        self.add_sequence(seq, prompt_text_of(self.tokenizer, prompt, messages, seq))
        return seq

    def make_sequence(
        self,
        request_id: str,
        prompt=None,
        params: SamplingParams | None = None,
        priority_class: str = "interactive",
        priority: int = 0,
        arrival_time: float | None = None,
        messages: list[dict] | None = None,
        lora_request=None,
    ) -> Sequence:
        """Tokenize and validate without touching engine state; ``lora_request``: an engine.LoRARequest."""
        seq = self.inputs.sequence_for(request_id, prompt, params, priority_class, priority, arrival_time, messages)
        seq.lora_request = self._checked_lora(lora_request)
        return seq

    def _checked_lora(self, request):
        if request is None:
            return None
        if not self.config.enable_lora:
            raise InvalidRequest("lora_request", "this engine serves no adapters (start it with enable_lora=True)")
        check_adapter(request, self.config.max_lora_rank, self.runner.lora.targets)
        return request

    def own_input_processor(self) -> InputProcessor:
        """Inputs for another thread (the replica's ingest), with a tokenizer of its own."""
        return self.inputs.with_tokenizer(AutoTokenizer.from_pretrained(self.tokenizer_dir))

    def add_sequence(self, seq: Sequence, prompt: str | None = None) -> None:
        """``prompt``: the text outputs report as ``RequestOutput.prompt`` (None: not kept).
        A request with n > 1 runs as n child sequences (engine/parallel_sampling.py)."""
        for member in self.samples.fan_out(seq, prompt):
            self.scheduler.add(member)
            self.outputs.add(member, prompt)

    def abort_request(self, request_id: str) -> None:
        """Ends the request (all its samples); its last output says finish_reason 'abort'."""
        for seq_id in self.samples.sequence_ids(request_id):
            seq = self.scheduler.finish(seq_id, "abort")
            if seq is not None:
                self._ended.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended)

    # ---- one step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs. Overlapped: the model runs step N+1 on its own thread while
        this applies step N's tokens (the first call returns no outputs)."""
        plan = self.schedule()
        if not plan.scheduled:
            self._idle()
        if self.runner.link is not None:
            return self._pipelined_step(plan)
        if not self.overlaps_steps:
            return self.postprocess(plan, self.runner.execute(plan))
        if self._model_thread is None:
            self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="conveyor-model")
        self._in_flight.append((plan, self._model_thread.submit(self.runner.execute, plan)))
        if len(self._in_flight) < 2:
            return []
        plan, future = self._in_flight.popleft()
        return self.postprocess(plan, future.result())

    def _pipelined_step(self, plan: StepPlan) -> list[RequestOutput]:
        """Pipeline parallel: launch the step (stage 0 runs it now); while fewer steps than
        stages are in flight and this one had work, return at once, else finish the oldest."""
        self.runner.launch(plan)
        self._pipelined.append(plan)
        working = sum(1 for launched in self._pipelined if launched.scheduled)
        self.max_steps_in_flight = max(self.max_steps_in_flight, working)
        if plan.scheduled and len(self._pipelined) < self.config.pipeline_parallel_size:
            return []
        oldest = self._pipelined.popleft()
        return self.postprocess(oldest, self.runner.finish(oldest))

    def schedule(self) -> StepPlan:
        """First half of a step (the actors run the model in between, elsewhere)."""
        plan = self.scheduler.schedule()
        self.num_steps += bool(plan.scheduled)
        return plan

    def postprocess(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Second half: apply sampled tokens, detokenize, end the sequences that a stop
        condition ended; outputs of the step."""
        failed = self._failed(plan, result)  # before update: it forgets which sequences the step had
        # before update, which forgets them; only for the steps that scored prompts
        scheduled = (
            {seq.seq_id: seq for seq in self.scheduler.in_flight[plan.step_id]} if result.prompt_logprobs else {}
        )
        updated = self.scheduler.update(plan, result)
        self._feed_prompt_logprobs(result, scheduled)
        for seq in updated:
            self._feed_and_finish(seq, result.logprobs.get(seq.seq_id))
            for token_id in result.extra_token_ids.get(seq.seq_id, ()):  # accepted drafts: one by one
                if seq.is_finished:
                    break  # a stop condition fired: the step's later tokens are dropped
                self.scheduler.append_token(seq, token_id)
                self._feed_and_finish(seq, None)
        for seq, reason in failed:
            self._fail(seq, reason)
        ended, self._ended = self._ended, []
        return self.samples.fan_in([(seq, self.outputs.output(seq)) for seq in ended + updated])

    def _feed_prompt_logprobs(self, result: StepResult, scheduled: dict[str, Sequence]) -> None:
        """To the step's own sequences (by object: one aborted while the step ran, and a new
        request that took its id, get none)."""
        for seq_id, (start, entries) in result.prompt_logprobs.items():
            seq = scheduled.get(seq_id)
            if seq is not None and not seq.is_finished:
                self.outputs.feed_prompt_logprobs(seq, start, entries)

    def _feed_and_finish(self, seq: Sequence, logprobs) -> None:
        """Detokenize the sequence's newest token, then end it if a stop condition holds."""
        hold_last = self.stop_rules.stops_on_token(seq) and not seq.params.include_stop_str_in_output
        self._finish_if_stopped(seq, self.outputs.feed(seq, logprobs, hold_last))

    def _finish_if_stopped(self, seq: Sequence, stop_string: str | None) -> None:
        """Every stop condition, checked once in StopRules' order; the one place a step ends a sequence."""
        reason = self.stop_rules.reason(seq, stop_string)
        if reason is not None:
            self.scheduler.finish(seq.seq_id, *reason)

    def _failed(self, plan: StepPlan, result: StepResult) -> list[tuple[Sequence, str]]:
        """The step's sequences the runner could not sample for (a structured output's dead end)."""
        if not result.errors:
            return []
        return [
            (seq, result.errors[seq.seq_id])
            for seq in self.scheduler.in_flight[plan.step_id]
            if seq.seq_id in result.errors
        ]

    def _fail(self, seq: Sequence, reason: str) -> None:
        if not seq.is_finished:  # else it ended meanwhile (aborted, or by an earlier step's token)
            self.scheduler.finish(seq.seq_id, "error")
            seq.error = reason
            self._ended.append(seq)

    @property
    def overlaps_steps(self) -> bool:
        """Whether ``step()`` runs the model for step N+1 on its own thread while it applies
        step N's tokens: only when asked (``async_scheduling=True``), offline and in the
        engine core alike (engine/engine_core.py steps this engine, whichever way it runs)."""
        return self.config.async_scheduling is True

    def seconds_until_ready(self) -> float:
        """0 when a step has work; else how long a dynamic batch window stays open (inf: idle)."""
        if self.scheduler.running or self._ended:
            return 0.0
        return self.scheduler.policy.seconds_until_ready(self.scheduler.waiting, time.time())

    def _idle(self) -> None:
        wait = self.seconds_until_ready()
        if self.scheduler.waiting and 0 < wait < float("inf"):
            time.sleep(wait)

    def stats(self) -> dict:
        pipeline = {"pp_max_steps_in_flight": self.max_steps_in_flight} if self.runner.link is not None else {}
        return {
            "num_steps": self.num_steps,
            **self.scheduler.kv_stats(),
            **spec_stats(self.scheduler.drafter),
            **self.runner.tp_stats(),
            **pipeline,
        }

    def close(self) -> None:
        """Stops the model thread and the other tensor-parallel ranks, if any."""
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=True)
        self._drain_pipeline()
        self.runner.close()

    def _drain_pipeline(self) -> None:
        """Takes the results of the steps still in flight (dropped), so no stage is left
        sending to a rank 0 that no longer listens; a failed rank ends the drain."""
        try:
            while self._pipelined:
                self.runner.finish(self._pipelined.popleft())
        except RuntimeError as exc:  # RankFailed, or a collective of a dead group
            log.info("pipeline parallel: steps in flight dropped at close (%s)", exc)


def prompt_text_of(tokenizer, prompt, messages, seq: Sequence) -> str | None:
    """vLLM's ``RequestOutput.prompt``: the text given, the chat template's rendering of
    ``messages``, None for token ids."""
    if isinstance(prompt, str):
        return prompt
    if messages is not None:
        return tokenizer.decode(seq.prompt_token_ids, skip_special_tokens=False)
    return None


def resolve_tokenizer_dir(tokenizer: str | None, model_dir):
    """The model's own tokenizer, or ``tokenizer``: a local directory (nothing is downloaded)."""
    if tokenizer is None:
        return model_dir
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"tokenizer: {tokenizer!r} is not a local directory (tokenizer.json or "
            f"tokenizer_config.json); Conveyor never downloads one"
        )
    return path


def resolve_max_model_len(config: EngineConfig, model_context: int) -> int:
    if config.max_model_len is None:
        return model_context
    if not 0 < config.max_model_len <= model_context:
        raise ModelLoadError(
            f"max_model_len: must be in [1, {model_context}] for this model, got {config.max_model_len}"
        )
    return config.max_model_len


__all__ = ["LLMEngine", "InvalidRequest"]
