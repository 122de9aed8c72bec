"""The operator's caps on the work one request may ask for: `n` (samples, --max-samples)
and n x max_tokens (--max-total-tokens), since every sample decodes up to max_tokens in
the same engine steps as everyone else's work. A request over either gets a 400 naming the
field and the limit; a chat naming no max_tokens gets at most its share of the total."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.apps.openai_api.errors import invalid
from conveyor.clients.protocol import JobRequest

DEFAULT_MAX_TOKENS = JobRequest.model_fields["max_tokens"].default


@dataclass(frozen=True)
class WorkCaps:
    max_samples: int
    max_total_tokens: int

    def check(self, fields: dict, max_tokens_param: str = "max_tokens") -> None:
        """OpenAIError(400) when the job's n or n x max_tokens is over a cap."""
        n = fields.get("n", 1)
        if n > self.max_samples:
            raise invalid(f"n: {n} is over this gateway's limit of {self.max_samples} (--max-samples)", param="n")
        max_tokens = fields.get("max_tokens", DEFAULT_MAX_TOKENS)
        if n * max_tokens > self.max_total_tokens:
            raise invalid(
                f"n x max_tokens: {n} x {max_tokens} = {n * max_tokens} is over this gateway's limit of "
                f"{self.max_total_tokens} (--max-total-tokens)",
                param=max_tokens_param,
            )

    def share(self, fields: dict) -> int:
        """The most max_tokens a job with this n may get by default."""
        return max(1, self.max_total_tokens // fields.get("n", 1))
