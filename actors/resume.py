"""Resume, not rerun (docs/reliability.md, "Resuming"): a job taken over from a replica that
died (or handed back past its grace period) continues from the output tokens its earlier
attempts published, instead of computing them again.

The published output is the job's out stream folded as every reader folds it (reruns
restart it, resumed attempts cut it to what they carried over: TokenEvent.carried_over).
It is input (any writer of the namespace can write the stream), so it is carried over only
when it passes its checks, else the job reruns from the start and the reason goes on its
record (``resume:<attempt>``):

- the attempt that published it ran the same model (``model:<n>``, written by START_LUA:
  the served name, vocabulary and a digest of the model's files);
- every token id is in the vocabulary, there are fewer than ``max_tokens``, and one output
  only (a job with ``n`` > 1 reruns);
- its text is what this replica's tokenizer makes of its tokens (the published characters
  are a prefix of their decoding);
- the job has not been resumed ``max_resumes`` times already.

Carried tokens that would already end the job (a stop string, EOS, a stop token id,
``max_tokens``: the attempt died between its last token and its end) are dropped from
there on: the engine samples that token again, and the job ends as it would have.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from conveyor.clients.errors import ProtocolError
from conveyor.clients.event_reader import EventReader
from conveyor.clients.events import TokenEvent
from conveyor.clients.protocol import JobRequest
from conveyor.engine.detokenizer import IncrementalDetokenizer

MAX_EVENTS = 65_536  # events of an out stream read at most (a job's own are one per step)
READ_PAGE = 1024


@dataclass(frozen=True)
class Carried:
    """What a new attempt continues from: token ids and the characters of their text its
    readers hold; or, with ``reason``, why it reruns from the start (then both are empty)."""

    token_ids: tuple[int, ...] = ()
    chars: int = 0
    reason: str | None = None
    num_published: int = 0  # output tokens the earlier attempts left (carried or recomputed)

    def note(self) -> str:
        """The job record's line about this attempt's start."""
        if self.reason is not None:
            return f"rerun from the start: {self.reason}"
        return f"resumed after {len(self.token_ids)} of {self.num_published} published tokens"


def model_identity(served_name: str, facts) -> str:
    """What a resumed job's earlier attempt must have run: the served name, the vocabulary and
    a digest of the model directory's tokenizer, config and weight files' names and sizes
    (the weights themselves are not read: a model rewritten in place under the same sizes
    would pass)."""
    folder, digest = Path(facts.tokenizer_dir), hashlib.sha256()
    for name in ("tokenizer.json", "config.json"):
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for weights in sorted(p for p in folder.glob("*") if p.suffix in (".safetensors", ".gguf", ".bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return f"{served_name[:200]}|vocab={facts.vocab_size}|files={digest.hexdigest()[:16]}"


def fold_published(entries: list[tuple]) -> tuple[str, list[int], str | None]:
    """(text, token ids, why not) of output 0 as the out stream's readers hold it now."""
    reader, text, token_ids = EventReader(), "", []
    for event in reader.feed(entries):
        if not isinstance(event, TokenEvent):
            return "", [], "the job already has a terminal event"
        if event.index != 0:
            return "", [], "a job with n > 1 reruns"
        text, token_ids, _ = event.carried_over(text, token_ids)
        text += event.text
        token_ids = token_ids + list(event.token_ids)
    return text, token_ids, None


class Resumer:
    """Decides what a new attempt of a job carries over (the front door's, per namespace)."""

    def __init__(self, tokenizer, eos_token_ids, vocab_size: int, identity: str, max_resumes: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.identity = identity
        self.max_resumes = max_resumes

    def check(
        self, job: JobRequest, prompt_ids: list[int], attempt: int, earlier_identity: str | None, entries: list[tuple]
    ) -> Carried:
        """What attempt ``attempt`` of ``job`` continues from, given its prompt's token ids,
        the earlier attempt's model identity and the out stream's entries (runs on a worker
        thread: it decodes)."""
        try:
            text, token_ids, why_not = fold_published(entries)
        except ProtocolError as exc:  # a junk entry (any writer of the namespace can add one)
            return Carried(reason=f"an event cannot be read: {str(exc)[:200]}")
        if not token_ids and why_not is None:
            return Carried()  # nothing published: nothing to carry, nothing to explain
        reason = why_not or self._refusal(job, attempt, earlier_identity, token_ids)
        if reason is None:
            return self._trimmed(job, prompt_ids, text, token_ids)
        return Carried(reason=reason, num_published=len(token_ids))

    def _refusal(self, job: JobRequest, attempt: int, earlier: str | None, token_ids: list[int]) -> str | None:
        if self.max_resumes <= 0:
            return "resuming is off (--max-resumes 0)"
        if attempt - 1 > self.max_resumes:
            return f"resumed {self.max_resumes} times already (--max-resumes {self.max_resumes})"
        if job.n != 1:
            return "a job with n > 1 reruns"
        if earlier != self.identity:
            return f"the earlier attempt ran {earlier or 'an unrecorded model'!r}, this one {self.identity!r}"
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            return "a published token id is outside the vocabulary"
        if len(token_ids) > job.max_tokens:
            return f"{len(token_ids)} published tokens, more than max_tokens ({job.max_tokens})"
        return None

    def _trimmed(self, job: JobRequest, prompt_ids: list[int], text: str, token_ids: list[int]) -> Carried:
        """The published tokens before the first one that would end the job, checked against
        their text as this replica's detokenizer makes it (the engine's own, prompt included)."""
        keep, detok = len(token_ids), self._detokenizer(job, prompt_ids)
        for index, token in enumerate(token_ids):
            if self._ends_job(job, index, token):
                keep = index
                break
            detok.add(token)
            if detok.stop_string is not None:
                keep = index
                break
        if keep < len(token_ids):  # the text of the kept tokens alone
            detok = self._detokenizer(job, prompt_ids)
            for token in token_ids[:keep]:
                detok.add(token)
        kept_text = detok.text
        chars = min(len(text), len(kept_text))
        longer = keep == len(token_ids) and len(text) > len(kept_text)
        if longer or text[:chars] != kept_text[:chars]:
            return Carried(
                reason="the published text is not what this replica's tokenizer makes of its tokens",
                num_published=len(token_ids),
            )
        return Carried(tuple(token_ids[:keep]), chars, num_published=len(token_ids))

    def _ends_job(self, job: JobRequest, index: int, token: int) -> bool:
        """Whether the output's token ``index`` would have ended the job (so is sampled again)."""
        if index + 1 >= job.max_tokens:
            return True
        structured = job.structured_outputs is not None or job.tools is not None
        if token in job.stop_token_ids and index + 1 >= job.min_tokens:
            return True
        return token in self.eos_token_ids and (structured or not job.ignore_eos)

    def _detokenizer(self, job: JobRequest, prompt_ids: list[int]) -> IncrementalDetokenizer:
        params = job.sampling_params()  # skip_special_tokens & co. are the engine's defaults: jobs cannot set them
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, list(params["stop"]))
