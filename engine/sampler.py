"""Turns a step's logits into one token per sequence, batched across the step."""

from dataclasses import dataclass

import torch

from conveyor.engine.plan import TokenLogprobs
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels.sampling import apply_penalties, apply_top_k_top_p_min_p, greedy_tokens, sample_with_noise


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence (owned by the model runner)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    min_tokens_stop_ids: tuple[int, ...]
    generator: torch.Generator | None  # per-request seed: the same draws whatever the batch

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Sampler:
    def __init__(self, device: torch.device, seed: int, fused: bool = False):
        """``fused``: penalties and the draw in Triton kernels (kernels/triton/sampling.py; CUDA)."""
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.fused = None
        if fused:
            from conveyor.kernels.triton import sampling

            self.fused = sampling

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]):
        """Returns (token ids, {row index: TokenLogprobs} for rows that asked for logprobs)."""
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, rows)
        self._add_logit_bias(logits, rows)  # before the penalties, as in vLLM
        if any(r.params.has_penalties for r in rows):
            logits = self._penalize(logits, rows)
        self._ban_until_min_tokens(logits, rows)
        if all(r.params.greedy for r in rows):  # decided on the host: no device sync
            tokens = greedy_tokens(logits)
        elif self.fused is not None:  # the kernel takes greedy rows itself
            tokens = self._sample_fused(logits, rows)
        else:
            greedy = torch.tensor([r.params.greedy for r in rows], device=self.device)
            tokens = torch.where(greedy, greedy_tokens(logits), self._sample(logits, rows))
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, rows, token_list)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        temperature = self._column([1.0 if p.greedy else p.temperature for p in params])
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            logits = apply_top_k_top_p_min_p(
                logits,
                self._column([p.top_k for p in params], torch.long),
                self._column([p.top_p for p in params]),
                self._column([p.min_p for p in params]),
            )
        probs = logits.softmax(dim=-1)
        return sample_with_noise(probs, self._exponential_noise(probs, rows))

    def _sample_fused(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        noise = self._exponential_noise(logits, rows)
        return self.fused.sample(
            logits.contiguous(),
            self._column([0.0 if p.greedy else p.temperature for p in params]),
            self._column([p.top_k for p in params], torch.long),
            self._column([p.top_p for p in params]),
            self._column([p.min_p for p in params]),
            noise,
        )

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for index, row in enumerate(rows):
            if row.generator is not None:
                noise[index].exponential_(generator=row.generator)
        return noise

    def advance(self, generator: torch.Generator, num_rows: int, vocab: int) -> None:
        """Draw from a row's ``generator`` as ``_exponential_noise`` does for ``num_rows`` rows
        (speculative decoding rewinds a seeded row to one draw per token it keeps)."""
        row = torch.empty(vocab, dtype=torch.float32, device=self.device)
        for _ in range(num_rows):
            row.exponential_(generator=generator)

    def _penalize(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        output_counts = self._counts([r.token_ids[r.num_prompt_tokens :] for r in rows], vocab)
        prompt_counts = self._counts([r.token_ids[: r.num_prompt_tokens] for r in rows], vocab)
        params = [r.params for r in rows]
        penalize = apply_penalties if self.fused is None else self.fused.apply_penalties_
        return penalize(
            logits.contiguous(),
            (output_counts + prompt_counts) > 0,
            output_counts,
            self._column([p.repetition_penalty for p in params]),
            self._column([p.presence_penalty for p in params]),
            self._column([p.frequency_penalty for p in params]),
        )

    def _counts(self, token_lists: list[list[int]], vocab: int) -> torch.Tensor:
        width = max(1, max(len(t) for t in token_lists))
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for index, tokens in enumerate(token_lists):
            padded[index, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        counts = torch.zeros(len(token_lists), vocab + 1, device=self.device)
        counts.scatter_add_(1, padded.to(self.device), torch.ones_like(padded, dtype=counts.dtype, device=self.device))
        return counts[:, :vocab]

    def _add_logit_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for index, row in enumerate(rows):
            if row.params.logit_bias:
                ids = self._column(list(row.params.logit_bias), torch.long)
                logits[index].index_add_(0, ids, self._column(list(row.params.logit_bias.values())))

    @staticmethod
    def _ban_until_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for index, row in enumerate(rows):
            if row.min_tokens_stop_ids and row.num_output_tokens < row.params.min_tokens:
                logits[index, list(row.min_tokens_stop_ids)] = float("-inf")

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
        if all(r.params.logprobs is None for r in rows):
            return None
        return logits.log_softmax(dim=-1)

    def _logprobs(self, raw: torch.Tensor | None, rows: list[SamplingRow], tokens: list[int]):
        if raw is None:
            return {}
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        ranks = token_ranks(raw[wanted], self._column([tokens[i] for i in wanted], torch.long)).tolist()
        return {
            index: token_logprobs(raw[index], tokens[index], rows[index].params.logprobs, rank)
            for index, rank in zip(wanted, ranks)
        }

    def _column(self, values: list, dtype=torch.float32) -> torch.Tensor:
        if self.device.type == "cuda":  # from pinned memory: the copy does not wait for the device
            return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(values, dtype=dtype, device=self.device)


def token_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Per row, the vocabulary rank of ``token_ids[row]``: how many tokens are at least as
    likely (vLLM's definition: 1 for the most likely, ties count against it). One pass."""
    chosen = logprobs.gather(1, token_ids[:, None])
    return (logprobs >= chosen).sum(dim=-1)


def token_logprobs(row: torch.Tensor, token_id: int, num_top: int, rank: int) -> TokenLogprobs:
    """The logprob of ``token_id`` in ``row`` (a log_softmax) and the ``num_top`` best."""
    top = row.topk(num_top) if num_top else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprobs(token_id, float(row[token_id]), pairs, rank)
