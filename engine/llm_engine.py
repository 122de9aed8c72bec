"""The incremental engine: add / abort requests, ``step()``, and their outputs.

One step is schedule -> run -> update -> detokenize. The actors drive the same pieces
(Scheduler, ModelRunner, OutputProcessor) from separate tasks; this class wires them
synchronously for the offline API.
"""
import time

from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.errors import InvalidRequest, ModelLoadError
from engine.input_processor import InputProcessor
from engine.model_runner import ModelRunner
from engine.models.loader import load_spec
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.plan import StepPlan
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.spec = load_spec(config.model)
        self.max_model_len = resolve_max_model_len(config, self.spec.max_context)
        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.model_dir)
        self.runner = ModelRunner(config, self.spec, self.max_model_len)
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.max_model_len,
                                   self.spec.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, self.spec.hf_config.vocab_size, self.max_model_len,
                                     self.runner.num_blocks * config.block_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ended: list[Sequence] = []  # aborted or failed outside a step: reported next step

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority_class: str = "interactive", priority: int = 0,
                    arrival_time: float | None = None) -> Sequence:
        """``prompt``: text, token ids, or chat messages (list of dicts). Raises InvalidRequest."""
        params = params or SamplingParams()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            token_ids = self.inputs.apply_chat_template(prompt)
        else:
            token_ids = self.inputs.tokenize(prompt)
        seq = self.inputs.make_sequence(request_id, token_ids, params, priority_class, priority, arrival_time)
        self.scheduler.add(seq)
        self.outputs.add(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.finish(request_id, "abort")
        if seq is not None:
            self._ended.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended)

    # ---- one step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            self._idle(plan)
        result = self.runner.execute(plan)
        updated = self.scheduler.update(plan, result)
        for seq in updated:
            stop = self.outputs.feed(seq, result.logprobs.get(seq.seq_id))
            if stop is not None:
                self._stop_on_string(seq, stop)
        ended, self._ended = self._ended, []
        return [self.outputs.output(seq) for seq in ended + updated]

    def _stop_on_string(self, seq: Sequence, stop: str) -> None:
        if seq.is_finished:  # it hit max_tokens on the same token: the stop string wins
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            self.scheduler.finish(seq.seq_id, "stop", stop)

    def _idle(self, plan: StepPlan) -> None:
        """Nothing to run: a dynamic batch may be waiting for its window to close."""
        wait = self.scheduler.policy.seconds_until_ready(self.scheduler.waiting, time.time())
        if self.scheduler.waiting and 0 < wait < float("inf"):
            time.sleep(wait)

    def stats(self) -> dict:
        return self.scheduler.kv_stats()


def resolve_max_model_len(config: EngineConfig, model_context: int) -> int:
    if config.max_model_len is None:
        return model_context
    if not 0 < config.max_model_len <= model_context:
        raise ModelLoadError(f"max_model_len: must be in [1, {model_context}] for this model, "
                             f"got {config.max_model_len}")
    return config.max_model_len


__all__ = ["LLMEngine", "InvalidRequest"]
