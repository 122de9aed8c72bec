"""Options, prompts, token budgets and job ids of the summarization pipeline (no I/O)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.apps.documents.chunking import Chunk, split_text
from conveyor.apps.documents.doc_layout import section_starts
from conveyor.apps.documents.documents import Document
from conveyor.clients.errors import ConveyorError
from conveyor.clients.limits import MAX_RESULT_TTL
from conveyor.clients.submission import JOB_FIELDS

# Asking for a few complete sentences keeps SmolLM2 inside its budget; a last sentence cut by
# the budget is dropped anyway (summary_points.finished).
DEFAULT_MAP_INSTRUCTION = (
    "Summarize the following text in two to four complete sentences, each stating one fact. "
    "Reply with the summary only."
)
DEFAULT_REDUCE_INSTRUCTION = (
    "Here are summaries of consecutive parts of one document. Combine them into one summary of the "
    "whole document in three to six complete sentences; state each point once. Reply with the summary only."
)
# The one retry of a map or reduce job whose answer held no usable sentence (filler, or not
# grounded in its chunks: see grounding.py) asks differently: for facts in the text's own words.
RETRY_MAP_INSTRUCTION = "State two facts from the following text, each in one complete sentence using its own words."
RETRY_REDUCE_INSTRUCTION = (
    "State the three most important facts in these notes, each in one complete sentence using their words."
)
SCHEMA_INSTRUCTION = " Reply with one JSON object under the given schema."
PIPELINE_FIELDS = frozenset(
    {
        "job_id",
        "prompt",
        "messages",
        "prompt_token_ids",
        "model",
        "metadata",
        "max_tokens",
        "temperature",
        "priority_class",
        "result_ttl",
        "repetition_penalty",
        "structured_outputs",
    }
)

Messages = list[dict[str, str]]


class SummarizeError(ConveyorError):
    """One document could not be summarized (the others go on)."""

    code = "summarize_failed"


class SummarizeOptions(BaseModel):
    """How documents are chunked and summarized. Every field that changes a summary is
    part of its job ids, so a rerun with the same options reuses finished jobs."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    model: str | None = Field(
        None, description="model to use (None: the only one published); naming one sends the jobs to its own streams"
    )
    max_tokens: int = Field(160, ge=1, description="tokens per summary (map and reduce)")
    max_chunk_tokens: int | None = Field(
        1024,
        ge=1,
        description="cap on a chunk's tokens (None: what the "
        "context allows; SmolLM2 starts to loop on much longer chunks)",
    )
    context_tokens: int | None = Field(None, ge=2, description="cap on prompt + summary tokens per job")
    overlap_tokens: int = Field(0, ge=0, description="tokens repeated from one chunk into the next")
    map_instruction: str = Field(DEFAULT_MAP_INSTRUCTION, min_length=1)
    reduce_instruction: str = Field(DEFAULT_REDUCE_INSTRUCTION, min_length=1)
    system_prompt: str | None = Field(None, description="system message (None: the chat template's own)")
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy")
    repetition_penalty: float = Field(
        1.15, ge=1.0, le=2.0, description="above 1 discourages repeating tokens (greedy small models loop without it)"
    )
    schema_: dict[str, Any] | None = Field(
        None,
        alias="schema",
        description="JSON schema every map and reduce "
        "step answers under (structured outputs); the final JSON validates",
    )
    job_options: dict[str, Any] = Field(default_factory=dict, description="more job fields: seed, stop, ...")
    priority_class: Literal["interactive", "batch"] = "batch"
    max_in_flight: int = Field(8, ge=1, description="jobs submitted and not yet finished, per pipeline")
    job_timeout: float | None = Field(None, gt=0.0, description="seconds to wait for one job's result")
    result_ttl: int = Field(7 * 86_400, ge=1, le=MAX_RESULT_TTL, description="how long results stay reusable")
    retry_failed: bool = Field(True, description="resubmit jobs that ended in error in an earlier run")

    @field_validator("job_options")
    @classmethod
    def _only_other_job_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(set(value) - (JOB_FIELDS - PIPELINE_FIELDS))
        if bad:
            raise ValueError(f"{bad[0]!r} is not a job field the pipeline leaves to you")
        return value

    @field_validator("schema_")
    @classmethod
    def _a_valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            import jsonschema

            try:
                jsonschema.validators.validator_for(value).check_schema(value)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        return value

    def job_fields(self) -> dict[str, Any]:
        return {"priority_class": self.priority_class, "result_ttl": self.result_ttl, **self.output_fields()}

    def output_fields(self) -> dict[str, Any]:
        """What changes a job's output (hashed into its id); priority and TTL do not."""
        fields = {"max_tokens": self.max_tokens, "temperature": self.temperature, **self.job_options}
        if self.repetition_penalty != 1.0:
            fields["repetition_penalty"] = self.repetition_penalty
        if self.schema_ is not None:
            # no free whitespace: with bounded strings the JSON then fits a known token budget
            fields["structured_outputs"] = {"json": self.schema_, "disable_any_whitespace": True}
        return fields


class Prompts:
    """Map and reduce prompts of one run and their exact token counts."""

    def __init__(self, options: SummarizeOptions, counter: Any, max_model_len: int) -> None:
        self.options = options
        self.counter = counter
        self.context = min(max_model_len, options.context_tokens or max_model_len)

    def map_messages(self, chunk: str) -> Messages:
        return self._chat(f"{self._instruction(self.options.map_instruction)}\n\n{chunk}")  # shared prefix

    def reduce_messages(self, summaries: list[str]) -> Messages:
        return self._chat(self._instruction(self.options.reduce_instruction) + "".join(f"\n\n{s}" for s in summaries))

    def retry_map_messages(self, chunk: str) -> Messages:
        return self._chat(f"{RETRY_MAP_INSTRUCTION}\n\n{chunk}")

    def retry_reduce_messages(self, summaries: list[str]) -> Messages:
        return self._chat(RETRY_REDUCE_INSTRUCTION + "".join(f"\n\n{s}" for s in summaries))

    def _map_excess(self, chunk: str) -> int:
        """Excess of a chunk's map prompt or of its retry (without a schema), whichever is longer."""
        retry = [] if self.options.schema_ is not None else [self.excess(self.retry_map_messages(chunk))]
        return max([self.excess(self.map_messages(chunk)), *retry])

    def _reduce_excess(self, summaries: list[str]) -> int:
        retry = [] if self.options.schema_ is not None else [self.excess(self.retry_reduce_messages(summaries))]
        return max([self.excess(self.reduce_messages(summaries)), *retry])

    def _instruction(self, text: str) -> str:
        return text + SCHEMA_INSTRUCTION if self.options.schema_ is not None else text

    def _chat(self, user: str) -> Messages:
        system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    def excess(self, messages: Messages) -> int:
        """Tokens by which prompt + summary exceed the context (<= 0: fits)."""
        return self.counter.count_chat(messages) + self.options.max_tokens - self.context

    def chunk_budget(self) -> int:
        """Token budget of a chunk's text: what the context leaves beside the instruction."""
        room = -self._map_excess("")
        if room < 1:
            raise SummarizeError(
                f"the map instruction and max_tokens {self.options.max_tokens} leave no room for text "
                f"in a context of {self.context} tokens"
            )
        return min(room, self.options.max_chunk_tokens or room)

    def chunks(self, doc: Document) -> list[Chunk]:
        """Chunks of the document's text within the budget, cut where its sections start."""
        cap = self.options.max_chunk_tokens

        def chunk_excess(text: str) -> int:
            over_cap = self.counter.count(text, add_special_tokens=False) - cap if cap else 0
            return max(over_cap, self._map_excess(text))

        budget = self.chunk_budget()
        return split_text(
            doc.text,
            self.counter.offsets(doc.text),
            budget,
            self.options.overlap_tokens,
            chunk_excess,
            section_starts(doc.text, doc.spans),
        )

    def groups(self, summaries: list[str]) -> list[list[str]]:
        return [[summaries[i] for i in group] for group in self.group_indices(summaries)]

    def group_indices(self, summaries: list[str]) -> list[list[int]]:
        """Consecutive summaries (their indices) packed greedily into reduce prompts that fit."""
        groups: list[list[int]] = [[]]
        for index, summary in enumerate(summaries):
            members = [summaries[i] for i in groups[-1]]
            if groups[-1] and self._reduce_excess([*members, summary]) > 0:
                groups.append([])
            groups[-1].append(index)
        if len(groups) == len(summaries) > 1:
            raise SummarizeError(
                f"two summaries of up to {self.options.max_tokens} tokens do not fit one reduce prompt in a "
                f"context of {self.context} tokens: lower max_tokens or raise context_tokens"
            )
        return groups


def job_id(
    kind: str, doc: Document, level: int, index: int, messages: Messages, options: SummarizeOptions, model: str
) -> str:
    """Deterministic id: the same document, step, prompt, parameters and model give the same job."""
    key = {
        "kind": kind,
        "document": doc.sha256,
        "level": level,
        "index": index,
        "messages": messages,
        "params": options.output_fields(),
        "model": model,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"sum-{kind}-{digest[:40]}"
