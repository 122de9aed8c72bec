"""Offline API, vLLM's shape: ``LLM(model, **options).generate(prompts, params)``.

Deliberate difference: a request with invalid parameters does not raise (vLLM's does);
it comes back as its own output with ``finish_reason='error'`` and ``error`` set, so the
rest of a batch still runs (README, "Offline API").
"""

import itertools
from typing import Sequence as Seq

from tqdm import tqdm

from conveyor.engine.config import EngineConfig
from conveyor.engine.errors import InvalidRequest
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.engine.prompt_inputs import cache_salt_of, engine_prompt, prompt_list
from conveyor.engine.sampling_params import MAX_N, SamplingParams


class LLM:
    def __init__(self, model: str = EngineConfig.model, **options):
        """``options``: EngineConfig's fields, and vLLM's names (engine/vllm_options.py)."""
        self.engine = LLMEngine(EngineConfig.from_options(model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine underneath."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` and ``chat`` use without ``sampling_params``: SamplingParams
        with the model's generation config as defaults (``generation_config="auto"``, the
        default), or SamplingParams() (``"vllm"``, or a model whose config states none)."""
        return self.engine.sampling_defaults.params()

    def close(self) -> None:
        """Frees what outlives a Python reference: the other tensor-parallel ranks' processes
        (they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """``prompts``: one prompt or a list (engine/prompt_inputs.py: strings, token-id lists,
        vLLM's prompt dicts). Outputs come back in prompt order; a bad request yields
        ``finish_reason='error'`` on its own output. ``lora_request``: one engine.LoRARequest
        for every prompt, or a list (one per prompt, None for the base model)."""
        return self._run(prompt_list(prompts), sampling_params, use_tqdm, priority, lora_request=lora_request)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """``messages``: one conversation (list of {role, content}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run(conversations, sampling_params, use_tqdm, None, chat=True)

    def _run(
        self, prompts: list, sampling_params, use_tqdm: bool, priority, chat: bool = False, lora_request=None
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(prompts))
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, param, prio, lora in zip(prompts, params, priorities, loras):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                self._add(request_id, prompt, param, prio, chat, lora)
            except InvalidRequest as exc:
                results[request_id] = _error_output(request_id, prompt, param, exc)
        self._drain(results, len(order), use_tqdm)
        return [results[request_id] for request_id in order]

    def _add(self, request_id: str, prompt, params: SamplingParams, priority: int, chat: bool, lora=None) -> None:
        if chat:
            self.engine.add_request(request_id, params=params, priority=priority, messages=prompt, lora_request=lora)
            return
        value, text = engine_prompt(prompt)
        seq = self.engine.make_sequence(request_id, value, params, priority=priority, lora_request=lora)
        seq.cache_salt = cache_salt_of(prompt)
        self.engine.add_sequence(seq, text)

    def _drain(self, results: dict, total: int, use_tqdm: bool) -> None:
        bar = tqdm(
            total=total, initial=len(results), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        generated = 0
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                generated += output.num_new_tokens
                if output.finished:
                    results[output.request_id] = output
                    bar.update(1)
            bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
        bar.close()


def _per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} for {count} prompts")
    return params


def _error_output(request_id: str, prompt, params: SamplingParams, exc: InvalidRequest) -> RequestOutput:
    """One failed output per sample asked for (n, when n itself is valid)."""
    value = prompt.get("prompt_token_ids", prompt.get("prompt")) if isinstance(prompt, dict) else prompt
    prompt_ids = list(value) if isinstance(value, list) and all(isinstance(t, int) for t in value) else []
    n = params.n if isinstance(params.n, int) and 1 <= params.n <= MAX_N else 1
    failed = [CompletionOutput(index, "", [], finish_reason="error") for index in range(n)]
    return RequestOutput(
        request_id, value if isinstance(value, str) else None, prompt_ids, outputs=failed, finished=True, error=str(exc)
    )
