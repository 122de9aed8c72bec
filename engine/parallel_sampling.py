"""Parallel sampling (``SamplingParams.n > 1``): a request fans out into n child sequences
that share its prompt's KV blocks, and their outputs fan back in as one RequestOutput.

Children are ``f"{request_id}#{i}"`` ('#' cannot occur in a job id, so a child's id is
never another request's). Child 0 is the leader: the scheduler admits the others only
once the leader's prompt is computed (``waits_for_leader``), by which time its full
blocks are in the prefix cache, so each follower takes them by reference
(``BlockManager.reuse_cached_prefix``) and computes only the prompt's last, partial
block (at most ``block_size`` tokens). With prefix caching off, nothing is held back and
every child computes the whole prompt.

Seeds as in vLLM (``ParentRequest._get_child_sampling_params``): with ``seed`` s child i
samples with s + i, so the n outputs are the same run to run and whatever else is in the
batch; without a seed each child draws from the engine's generator. Only the leader
scores the prompt (``prompt_logprobs``): the followers keep the prefix cache.
"""

import dataclasses

from conveyor.engine.outputs import CompletionOutput, RequestOutput, RequestTimestamps
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def waits_for_leader(seq: Sequence) -> bool:
    """A follower is held back until its leader's prompt is computed (or the leader ended)."""
    leader = seq.leader
    return leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    child = dataclasses.replace(params, n=1)
    if params.seed is not None:
        child.seed = params.seed + index
    if index:
        child.prompt_logprobs = None
    return child


def make_children(seq: Sequence, share_prefix: bool) -> list[Sequence]:
    children = []
    for index in range(seq.params.n):
        child = Sequence(
            child_id(seq.seq_id, index),
            list(seq.token_ids),
            child_params(seq.params, index),
            seq.max_tokens,
            seq.priority_class,
            seq.priority,
            seq.arrival_time,
            grammar=seq.grammar,
        )  # compiled once; each child's runner row gets its own matcher
        child.sample_index = index
        child.lora_request = seq.lora_request
        child.cache_salt = seq.cache_salt
        child.tenant = seq.tenant
        child.leader = children[0] if index and share_prefix else None
        children.append(child)
    return children


class ParentRequest:
    """The request's view of its children: the latest output of each, one merged output a step."""

    def __init__(self, request_id: str, children: list[Sequence], prompt: str | None):
        self.request_id = request_id
        self.children = children
        self.prompt = prompt
        self.latest: list[RequestOutput | None] = [None] * len(children)  # per index

    def merge(self, step_outputs: list[RequestOutput]) -> RequestOutput:
        """This step's outputs of some children -> the request's: all n completions in index
        order, the deltas only on those that advanced."""
        for output in step_outputs:
            self.latest[output.outputs[0].index] = output
        fresh = {output.outputs[0].index for output in step_outputs}
        completions = [self._completion(index, index in fresh) for index in range(len(self.children))]
        known = [output for output in self.latest if output is not None]
        finished = all(output is not None and output.finished for output in self.latest)
        leader = self.latest[0] or known[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=leader.prompt_token_ids,
            prompt_logprobs=self.latest[0].prompt_logprobs if self.latest[0] else None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(output.num_cached_tokens or 0 for output in known),
            timestamps=_combined([output.timestamps for output in self.latest]) if finished else None,
            num_preemptions=sum(output.num_preemptions for output in known),
            error=next((output.error for output in known if output.error), None),
        )

    def _completion(self, index: int, fresh: bool) -> CompletionOutput:
        output = self.latest[index]
        if output is None:
            return CompletionOutput(index, "", [])  # not admitted yet
        return output.outputs[0] if fresh else output.outputs[0].without_deltas()


def _combined(times: list[RequestTimestamps]) -> RequestTimestamps:
    """The request's timestamps: its first child's first events, its last child's end."""

    def first(values):
        known = [value for value in values if value is not None]
        return min(known) if known else None

    return RequestTimestamps(
        min(t.arrival for t in times),
        first([t.first_scheduled for t in times]),
        first([t.first_token for t in times]),
        max(t.finished for t in times),
    )


class ParallelSampling:
    """The engine's requests with n > 1: fan-out on add, fan-in of outputs, their children's ids."""

    def __init__(self, share_prefix: bool):
        self.share_prefix = share_prefix
        self.parents: dict[str, ParentRequest] = {}  # request id -> its parent, until it finishes
        self.parent_of: dict[Sequence, ParentRequest] = {}  # child -> its parent, until the child finishes

    def fan_out(self, seq: Sequence, prompt: str | None) -> list[Sequence]:
        """The sequences to schedule for ``seq``'s request: itself when n == 1."""
        if seq.params.n == 1:
            return [seq]
        children = make_children(seq, self.share_prefix)
        parent = self.parents[seq.seq_id] = ParentRequest(seq.seq_id, children, prompt)
        self.parent_of.update((child, parent) for child in children)
        return children

    def sequence_ids(self, request_id: str) -> list[str]:
        """The ids to abort for ``request_id``: its children's, or its own."""
        parent = self.parents.get(request_id)
        return [child.seq_id for child in parent.children] if parent else [request_id]

    def fan_in(self, outputs: list[tuple[Sequence, RequestOutput]]) -> list[RequestOutput]:
        """One output per request: children's outputs merged into their request's, in the
        place of its first child that reported this step."""
        merged: list[RequestOutput | ParentRequest] = []
        of_parent: dict[ParentRequest, list[RequestOutput]] = {}
        for seq, output in outputs:
            parent = self.parent_of.get(seq)
            if parent is None:
                merged.append(output)
                continue
            if parent not in of_parent:
                of_parent[parent] = []
                merged.append(parent)
            of_parent[parent].append(output)
            if output.finished:
                del self.parent_of[seq]
        return [self._merge(item, of_parent[item]) if isinstance(item, ParentRequest) else item for item in merged]

    def _merge(self, parent: ParentRequest, outputs: list[RequestOutput]) -> RequestOutput:
        output = parent.merge(outputs)
        if output.finished and self.parents.get(parent.request_id) is parent:
            del self.parents[parent.request_id]
        return output
