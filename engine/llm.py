"""Offline API, vLLM's shape: ``LLM(model, **options).generate(prompts, params)``."""
import itertools
from typing import Sequence as Seq

from tqdm import tqdm

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = EngineConfig.model, **options):
        self.engine = LLMEngine(EngineConfig.from_options(model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """``prompts``: a string, a list of strings, or a list of token-id lists. Outputs come
        back in prompt order; a bad request yields ``finish_reason='error'`` on its own output."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, priority)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """``messages``: one conversation (list of {role, content}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run(conversations, sampling_params, use_tqdm, None, chat=True)

    def _run(self, prompts: list, sampling_params, use_tqdm: bool, priority,
             chat: bool = False) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, param, prio in zip(prompts, params, priorities):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                if chat:
                    self.engine.add_request(request_id, params=param, priority=prio, messages=prompt)
                else:
                    self.engine.add_request(request_id, prompt, param, priority=prio)
            except InvalidRequest as exc:
                results[request_id] = _error_output(request_id, prompt, exc)
        self._drain(results, len(order), use_tqdm)
        return [results[request_id] for request_id in order]

    def _drain(self, results: dict, total: int, use_tqdm: bool) -> None:
        bar = tqdm(total=total, initial=len(results), desc="Generating", unit="req",
                   disable=not use_tqdm, dynamic_ncols=True)
        generated = 0
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                generated += len(output.new_token_ids)
                if output.finished:
                    results[output.request_id] = output
                    bar.update(1)
            bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
        bar.close()


def _per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} for {count} prompts")
    return params


def _error_output(request_id: str, prompt, exc: InvalidRequest) -> RequestOutput:
    prompt_ids = list(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else []
    return RequestOutput(request_id, prompt_ids, finished=True, finish_reason="error", error=str(exc))
