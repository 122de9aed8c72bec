"""Iteration-level scheduler: which sequences compute how many tokens in the next step.

Each step hands out at most ``max_num_batched_tokens`` tokens: running sequences first
(decodes, then prompt chunks, each in rank order), then waiting ones, so prefill chunks and
decodes share a step. While sequences wait, the running prompts' chunks take at most
``long_prefill_token_threshold`` tokens together (half the budget by default), and so does
each admitted prompt while others wait behind it: long prefills never hold back a waiting
job's first token, nor a decode, for more than a step. When KV blocks
run out, the lowest-ranked, latest-admitted running sequence is preempted and recomputed
later.

Steps may overlap (``EngineConfig.async_scheduling``): the next step is planned while one
is still in flight, counting the token each of its sequences will sample (its
``num_pending_samples``) without knowing it; the runner feeds those tokens in itself. A
sequence that step in flight will certainly end is not scheduled again, and a sequence in
flight is never preempted: where room runs out the plan is simply smaller. Under pipeline
parallel a sequence in flight is not scheduled at all (its next input is not known before
the step ends), so the steps in flight hold different sequences, each step at most 1/P of
the batch. Ranks: priority class (batch work ages into interactive), then the
integer priority (lower first), then arrival (admission, for running sequences). Waiting
sequences of several tenants are admitted by token-weighted fair share (engine/fair_share.py),
each tenant's in its own rank order.

With speculative decoding (``EngineConfig.speculative_config``) a decode may carry draft
tokens (engine/spec_decode/drafter.py), from what the step leaves once running and admitted
sequences have their tokens: drafts never preempt or delay a sequence. Their KV slots are
released as soon as the step says which were rejected, and the accepted ones join the
sequence (``append_token``) one at a time, after the stop checks of the one before.

The scheduler never decides that a sequence is done: the engine's postprocess checks the
stop conditions (engine/finishing.py) and calls ``finish``, the one way a sequence ends.
"""

import itertools
import time

from conveyor.engine.batching_policy import make_policy
from conveyor.engine.block_manager import BlockManager
from conveyor.engine.config import EngineConfig
from conveyor.engine.fair_share import FairShare
from conveyor.engine.finishing import StopRules
from conveyor.engine.parallel_sampling import waits_for_leader
from conveyor.engine.plan import NewSeqData, ScheduledSeq, StepPlan, StepResult
from conveyor.engine.sequence import PRIORITY_CLASSES, Sequence, SequenceStatus
from conveyor.engine.spec_decode.drafter import make_drafter


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, stop_rules: StopRules):
        self.config = config
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.policy = make_policy(config)
        self.fair = FairShare(config.tenant_shares)  # which tenant's waiting sequence is admitted next
        self.stop_rules = stop_rules  # here only for the sampler's min_tokens mask
        self.watermark_blocks = max(1, num_blocks // 100)  # headroom kept when admitting
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # steps that computed only part of a prompt
        self._admit_counter = itertools.count()
        self._step_ids = itertools.count(1)
        self.in_flight: dict[int, list[Sequence]] = {}  # step id -> the sequences it scheduled
        self.drafter = make_drafter(config.speculative_config, stop_rules.max_model_len)
        self.trimmed_tables: dict[str, int] = {}  # for the next plan: block tables shortened since
        # pipeline parallel: a sequence waits out its step in flight (the steps in flight hold
        # different sequences, as vLLM's virtual engines do)
        self.pipelined = config.pipeline_parallel_size > 1

    # ---- requests in and out -------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.seq_id not in self.seqs, f"duplicate request id {seq.seq_id!r}"
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        self.fair.arrived(seq)

    def finish(self, seq_id: str, reason: str, stop_reason=None) -> Sequence | None:
        """End a sequence (stop, length, abort, ...) and release its blocks. No-op if unknown."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        was_waiting = seq.status != SequenceStatus.RUNNING
        (self.waiting if was_waiting else self.running).remove(seq)
        self.block_manager.free(seq)
        self.trimmed_tables.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.forget(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.finished_time = time.time()
        self.policy.on_finish(seq)
        self.fair.finished(seq, was_waiting)
        if seq.known_to_runner:
            self.finished_ids.append(seq_id)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        now = time.time()
        plan = StepPlan(next(self._step_ids))
        self.in_flight[plan.step_id] = []
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: self._running_rank(s, now))  # preemption takes the last
        prompt_budget = self._prompt_chunk_cap(bool(self.waiting))  # running prompts' chunks, together
        out_of_room = False
        max_seqs = self._pipeline_share()
        for seq in sorted(self.running, key=lambda s: s.num_unscheduled_tokens > 1):  # decodes first
            if budget == 0 or len(plan.scheduled) == max_seqs:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted by _make_room for a sequence ranked above it
            if self.pipelined and seq.num_inflight_tokens:
                continue  # pipeline parallel: its next input is the token a step in flight samples
            is_prompt = seq.num_unscheduled_tokens > 1
            num_new = min(seq.num_unscheduled_tokens, budget, prompt_budget if is_prompt else budget)
            if num_new == 0 or self.stop_rules.ends_after_pending(seq):
                continue  # a step in flight computes its last token
            if not self._make_room(seq, seq.num_scheduled_tokens + num_new, plan):
                out_of_room = True
                break  # seq itself was the last one and got preempted, or a victim is in flight
            self._schedule(seq, num_new, plan, now)
            budget -= num_new
            prompt_budget -= num_new if is_prompt else 0
        if not (out_of_room or plan.preempted_ids):
            budget = self._admit_waiting(budget, plan, now, max_seqs)
        if self.drafter is not None:
            self._schedule_drafts(plan, budget)
        plan.finished_ids, self.finished_ids = self.finished_ids, []
        plan.trimmed_tables, self.trimmed_tables = self.trimmed_tables, {}
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Apply a step's sampled tokens; returns the sequences that got a token (the caller
        decides which of them are done)."""
        sampled = dict(zip(result.seq_ids, result.token_ids))
        now = time.time()
        updated = []
        for item, seq in zip(plan.scheduled, self.in_flight.pop(plan.step_id)):
            if seq.is_finished:
                continue  # ended (aborted, or by a step before this one) while the step ran
            seq.num_inflight_tokens -= item.num_new
            seq.num_computed_tokens += item.num_new - len(item.draft_token_ids)  # drafts: in append_token
            self.block_manager.register_full_blocks(seq)
            token_id = sampled.get(item.seq_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            seq.num_pending_samples -= 1
            seq.token_ids.append(token_id)
            seq.first_token_time = seq.first_token_time or now
            if item.draft_token_ids:
                self._release_rejected(seq, item, len(result.extra_token_ids.get(item.seq_id, ())))
            updated.append(seq)
        return updated

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """One more token of the step that just ended (an accepted draft's target, or the
        token after the last accepted draft): the draft at the position before it was right,
        so that position's KV, computed this step, now counts."""
        seq.num_computed_tokens += 1
        seq.token_ids.append(token_id)
        self.block_manager.register_full_blocks(seq)

    # ---- speculative decoding --------------------------------------------------------
    def _schedule_drafts(self, plan: StepPlan, budget: int) -> None:
        """Draft tokens for this plan's decodes, within the budget and the free KV slots the
        plan leaves (running sequences first, in rank order)."""
        if not self.drafter.drafts_step(len(plan.scheduled)):
            return
        for item, seq in zip(plan.scheduled, self.in_flight[plan.step_id]):
            if budget <= 0:
                return
            if item.num_new != 1 or item.num_computed + 1 != seq.num_tokens:
                continue  # only a decode (a last prompt token included) is followed by drafts
            room = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.config.block_size
            drafts = self.drafter.drafts_for(seq, min(budget, room - seq.num_tokens))
            if not drafts:
                continue
            self.block_manager.grow(seq, seq.num_tokens + len(drafts))
            item.new_block_ids.extend(self._unsent_blocks(seq))
            item.num_new += len(drafts)
            item.draft_token_ids = drafts
            seq.num_inflight_tokens += len(drafts)
            budget -= len(drafts)

    def _release_rejected(self, seq: Sequence, item: ScheduledSeq, num_accepted: int) -> None:
        """Count the drafts and give back the blocks only rejected drafts used: the sequence
        keeps room for the tokens it has plus the accepted ones still to be appended."""
        self.drafter.record(len(item.draft_token_ids), num_accepted)
        kept = self.block_manager.trim(seq, seq.num_tokens + num_accepted)
        if kept < seq.num_blocks_sent:
            seq.num_blocks_sent = kept
            self.trimmed_tables[seq.seq_id] = kept

    # ---- helpers ---------------------------------------------------------------------
    def _make_room(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = self.running[-1]  # sorted: the last one ranks lowest
            if victim.num_inflight_tokens:
                return False  # its step in flight still counts on its blocks: plan without it
            self.running.pop()
            self._preempt(victim)
            plan.preempted_ids.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        assert not seq.num_inflight_tokens, seq.seq_id
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_blocks_sent = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        self.fair.queued(seq)

    def _prompt_chunk_cap(self, others_wait: bool) -> int:
        """The most tokens prompt chunks may take this step: capped only while other sequences
        wait for room in the batch (an uncontended prefill keeps the whole budget)."""
        threshold = self.config.long_prefill_token_threshold
        if threshold is None:
            threshold = max(1, self.config.max_num_batched_tokens // 2)
        contended = others_wait and len(self.running) < self.config.max_num_seqs
        return threshold if threshold and contended else self.config.max_num_batched_tokens

    def _pipeline_share(self) -> int | None:
        """Pipeline parallel: at most 1/P of the sequences per step, so the P steps in flight
        each carry a share (sequences that all become free together would otherwise all go
        into one step, and the next would find none); None: no cap."""
        stages = self.config.pipeline_parallel_size
        if stages == 1:
            return None
        sequences = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)  # a queue beyond waits
        return max(1, -(-sequences // stages))

    def _admit_waiting(self, budget: int, plan: StepPlan, now: float, max_seqs: int | None = None) -> int:
        """Admit waiting sequences in rank order, tenants taking turns by fair share, while budget
        and blocks last; the budget left."""
        ranked = self.fair.admission_order(sorted(self.waiting, key=lambda s: self._waiting_rank(s, now)))
        admissible = list(self.policy.admissible(ranked, now))
        for index, seq in enumerate(admissible):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs or len(plan.scheduled) == max_seqs:
                return budget
            if waits_for_leader(seq):
                continue  # n > 1: it will share its leader's prompt blocks once they are computed
            if not self._adapter_fits(seq):
                continue  # its adapter would be one more than max_loras among the running
            if not seq.block_table:
                seq.num_computed_tokens = self.block_manager.reuse_cached_prefix(seq)
            chunk_cap = self._prompt_chunk_cap(others_wait=index + 1 < len(admissible))
            num_new = min(seq.num_unscheduled_tokens, budget, chunk_cap)
            reserve = self.watermark_blocks if self.running else 0
            if not self.block_manager.can_grow(seq, seq.num_computed_tokens + num_new, reserve):
                self.block_manager.free(seq)  # hand the cached prefix back; retried next step
                seq.num_computed_tokens = 0
                return budget
            self.waiting.remove(seq)
            self.fair.admitted(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.admit_order = next(self._admit_counter)
            self.running.append(seq)
            self._schedule(seq, num_new, plan, now)
            budget -= num_new
        return budget

    def _adapter_fits(self, seq: Sequence) -> bool:
        if seq.lora_request is None:
            return True
        running = {s.lora_request.lora_int_id for s in self.running if s.lora_request is not None}
        return seq.lora_request.lora_int_id in running or len(running) < self.config.max_loras

    def _schedule(self, seq: Sequence, num_new: int, plan: StepPlan, now: float) -> None:
        assert num_new > 0
        if num_new < seq.num_unscheduled_tokens:
            self.num_chunked_prefills += 1
        start = seq.num_scheduled_tokens
        self.block_manager.grow(seq, start + num_new)
        new_block_ids = self._unsent_blocks(seq)
        if not seq.known_to_runner:
            plan.new_seqs.append(
                NewSeqData(
                    seq.seq_id,
                    list(seq.token_ids),
                    seq.params,
                    self.stop_rules.min_tokens_stop_ids(seq),
                    seq.grammar,
                    seq.lora_request,
                    seq.num_prompt_tokens,
                )
            )
            seq.known_to_runner = True
        seq.first_scheduled_time = seq.first_scheduled_time or now
        plan.scheduled.append(ScheduledSeq(seq.seq_id, start, num_new, new_block_ids))
        self.in_flight[plan.step_id].append(seq)
        self.fair.charge(seq, num_new)
        seq.num_inflight_tokens += num_new
        if start + num_new == seq.num_tokens + seq.num_pending_samples:
            seq.num_pending_samples += 1  # this step samples its next token

    @staticmethod
    def _unsent_blocks(seq: Sequence) -> list[int]:
        """The block-table entries the runner does not have yet, now counted as sent."""
        new_block_ids = seq.block_table[seq.num_blocks_sent :]
        seq.num_blocks_sent = len(seq.block_table)
        return new_block_ids

    def _class_rank(self, seq: Sequence, now: float) -> int:
        rank = PRIORITY_CLASSES.index(seq.priority_class)
        if rank and now - seq.arrival_time >= self.config.batch_aging_s:
            return 0  # aged: batch work is never starved by a stream of interactive jobs
        return rank

    def _waiting_rank(self, seq: Sequence, now: float):
        return (self._class_rank(seq, now), seq.priority, seq.arrival_order)

    def _running_rank(self, seq: Sequence, now: float):
        return (self._class_rank(seq, now), seq.priority, seq.admit_order)

    # ---- observability ---------------------------------------------------------------
    def kv_stats(self) -> dict:
        allocated = sum(len(s.block_table) for s in self.running) * self.block_manager.block_size
        used = sum(s.num_computed_tokens for s in self.running)
        return {
            "kv_usage": self.block_manager.usage,
            "kv_fragmentation": (allocated - used) / allocated if allocated else 0.0,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "num_chunked_prefills": self.num_chunked_prefills,
            "prefix_cache_hit_rate": self.block_manager.prefix_hit_rate,
        }
