"""Scheduler and block manager on their own: accounting, ordering, preemption, policies."""

import time

import pytest

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.config import EngineConfig
from conveyor.engine.finishing import StopRules
from conveyor.engine.outputs import CompletionOutput, RequestOutput, RequestTimestamps
from conveyor.engine.plan import StepResult
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence

EOS = 1


def make_seq(seq_id, prompt_len, max_tokens=4, priority_class="interactive", priority=0, arrival=None):
    return Sequence(
        seq_id,
        list(range(10, 10 + prompt_len)),
        SamplingParams(temperature=0, max_tokens=max_tokens),
        max_tokens,
        priority_class,
        priority,
        arrival_time=arrival or time.time(),
    )


def make_scheduler(num_blocks=64, **options):
    config = EngineConfig(model="unused", block_size=4, **options)
    return Scheduler(config, num_blocks, StopRules({EOS}, max_model_len=1024))


def run_step(scheduler, token=7):
    """One step with a fake model that always samples ``token`` (the scheduler is under test),
    then the engine's token-level finishing."""
    plan = scheduler.schedule()
    sampled = [s.seq_id for s in plan.scheduled if s.num_computed + s.num_new == scheduler.seqs[s.seq_id].num_tokens]
    for seq in scheduler.update(plan, StepResult(sampled, [token] * len(sampled))):
        reason = scheduler.stop_rules.reason(seq)
        if reason is not None:
            scheduler.finish(seq.seq_id, *reason)
    return plan


def test_block_manager_allocates_and_frees_in_constant_steps():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", 5)
    assert manager.num_missing_blocks(seq, 5) == 2
    new_ids = manager.grow(seq, 5)
    assert len(new_ids) == 2 and seq.block_table == new_ids
    assert manager.grow(seq, 8) == [] and manager.num_free_blocks == 6
    manager.free(seq)
    assert seq.block_table == [] and manager.num_free_blocks == 8
    assert all(count == 0 for count in manager.ref_counts)


def seq_of(seq_id, token_ids):
    return Sequence(
        seq_id,
        list(token_ids),
        SamplingParams(temperature=0, max_tokens=4),
        4,
        "interactive",
        0,
        arrival_time=time.time(),
    )


def computed(manager, seq):
    """As the engine does after a prefill: blocks allocated, tokens computed, full blocks published."""
    manager.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_full_blocks(seq)


def test_prefix_cache_shares_full_blocks_by_reference_and_counts_hits():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = seq_of("first", range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    assert manager.reuse_cached_prefix(first) == 0
    computed(manager, first)
    assert len(manager.cached) == 2 and manager.num_free_blocks == 5

    second = seq_of("second", [*range(100, 108), 7, 7, 7])  # the same 2 full blocks, then its own
    assert manager.reuse_cached_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [manager.ref_counts[b] for b in second.block_table] == [2, 2]  # shared, not copied
    assert manager.prefix_queries == 10 + 11 and manager.prefix_hits == 8

    manager.free(first)
    assert [manager.ref_counts[b] for b in second.block_table] == [1, 1]
    assert manager.num_free_blocks == 6  # first's own tail block only
    manager.free(second)
    assert manager.num_free_blocks == 8 and all(count == 0 for count in manager.ref_counts)


def test_freed_cached_blocks_are_hits_until_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=4)
    prompt = list(range(200, 209))  # 2 full blocks + 1 token
    seq = seq_of("a", prompt)
    computed(manager, seq)
    manager.free(seq)
    assert manager.num_free_blocks == 4 and len(manager.cached) == 2  # free, content kept

    again = seq_of("b", prompt)
    assert manager.reuse_cached_prefix(again) == 8  # taken back from the free list
    manager.free(again)
    filler = seq_of("filler", range(900, 916))  # needs all 4 blocks: evicts the cached ones
    manager.grow(filler, filler.num_tokens)
    assert manager.cached == {} and manager.num_free_blocks == 0
    manager.free(filler)
    assert manager.reuse_cached_prefix(seq_of("c", prompt)) == 0


def test_last_token_is_never_served_from_the_cache():
    """Its logits must be computed: a prompt of exactly two full blocks reuses only one."""
    manager = BlockManager(num_blocks=8, block_size=4)
    computed(manager, seq_of("a", range(300, 308)))
    assert manager.reuse_cached_prefix(seq_of("b", range(300, 308))) == 4


def test_token_budget_mixes_decode_and_chunked_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_seq("short", 3, max_tokens=10))
    scheduler.add(make_seq("long", 20, max_tokens=2))
    first = run_step(scheduler)
    assert [(s.seq_id, s.num_new) for s in first.scheduled] == [("short", 3), ("long", 5)]
    second = run_step(scheduler)
    # the decode of "short" goes first, the rest of the budget continues the long prompt
    assert [(s.seq_id, s.num_new) for s in second.scheduled] == [("short", 1), ("long", 7)]
    assert scheduler.num_chunked_prefills >= 2
    assert all(plan.num_tokens <= 8 for plan in (first, second))


def test_interactive_before_batch_and_lower_priority_value_first():
    scheduler = make_scheduler(max_num_seqs=1)
    now = time.time()
    scheduler.add(make_seq("batch", 2, priority_class="batch", arrival=now))
    scheduler.add(make_seq("inter-low", 2, priority=5, arrival=now + 0.001))
    scheduler.add(make_seq("inter-high", 2, priority=-1, arrival=now + 0.002))
    order = []
    while scheduler.has_unfinished():
        plan = run_step(scheduler)
        order += [s.seq_id for s in plan.new_seqs]
    assert order == ["inter-high", "inter-low", "batch"]


def test_batch_work_ages_into_interactive():
    scheduler = make_scheduler(max_num_seqs=1, batch_aging_s=10)
    now = time.time()
    scheduler.add(make_seq("old-batch", 2, priority_class="batch", arrival=now - 60))
    scheduler.add(make_seq("fresh-interactive", 2, arrival=now))
    assert run_step(scheduler).new_seqs[0].seq_id == "old-batch"


def test_preemption_takes_lowest_rank_latest_admitted_and_loses_nothing():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    scheduler.add(make_seq("first", 8, max_tokens=8))
    scheduler.add(make_seq("second", 8, max_tokens=8))
    preempted = []
    finished = set()
    for _ in range(100):
        if not scheduler.has_unfinished():
            break
        plan = run_step(scheduler)
        preempted += plan.preempted_ids
        finished |= {sid for sid in ("first", "second") if sid not in scheduler.seqs}
    assert preempted and preempted[0] == "second"
    assert finished == {"first", "second"}
    assert scheduler.block_manager.num_free_blocks == 6


def test_stop_conditions():
    scheduler = make_scheduler()
    scheduler.add(make_seq("eos", 3, max_tokens=10))
    run_step(scheduler, token=EOS)
    assert "eos" not in scheduler.seqs
    scheduler.add(make_seq("length", 3, max_tokens=2))
    run_step(scheduler)
    assert "length" in scheduler.seqs
    run_step(scheduler)
    assert "length" not in scheduler.seqs


def test_update_appends_tokens_but_never_finishes():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", 3, max_tokens=1))
    plan = scheduler.schedule()
    [seq] = scheduler.update(plan, StepResult(["a"], [EOS]))
    assert seq.output_token_ids == [EOS] and not seq.is_finished and "a" in scheduler.seqs


def seq_with_output(output, max_tokens=10, **params):
    seq = Sequence("s", [10, 11, 12], SamplingParams(temperature=0, max_tokens=max_tokens, **params), max_tokens)
    seq.token_ids += output
    return seq


@pytest.mark.parametrize(
    "output, params, stop_string, expected",
    [
        ([7], {}, None, None),
        ([7, EOS], {}, None, ("stop", None)),
        ([EOS], {"ignore_eos": True}, None, None),
        ([EOS], {"min_tokens": 2}, None, None),  # before min_tokens: EOS does not end it
        ([7, 9], {"stop_token_ids": [9]}, None, ("stop", 9)),
        ([EOS], {"stop_token_ids": [EOS]}, None, ("stop", None)),  # EOS before stop token ids
        ([7] * 10, {}, None, ("length", None)),
        ([7] * 9 + [9], {"stop_token_ids": [9]}, None, ("stop", 9)),  # token-level before length
        ([7] * 10, {}, "end", ("stop", "end")),  # the stop string wins over length
        ([EOS], {}, "end", ("stop", "end")),  # ... and over EOS
        ([EOS], {"min_tokens": 2}, "end", ("stop", "end")),  # min_tokens holds back token ids only
    ],
)
def test_stop_rules_order(output, params, stop_string, expected):
    assert StopRules({EOS}, max_model_len=1024).reason(seq_with_output(output, **params), stop_string) == expected


def test_stop_rules_max_model_len():
    rules = StopRules({EOS}, max_model_len=5)
    assert rules.reason(seq_with_output([7])) is None
    assert rules.reason(seq_with_output([7, 7])) == ("length", None)


def test_abort_frees_blocks_and_tells_the_runner():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", 9, max_tokens=10))
    run_step(scheduler)
    seq = scheduler.finish("a", "abort")
    assert seq.finish_reason == "abort" and seq.block_table == []
    assert scheduler.schedule().finished_ids == ["a"]
    assert scheduler.finish("a", "abort") is None  # unknown: no-op


def test_dynamic_batching_waits_for_window_then_runs_batch_to_completion():
    scheduler = make_scheduler(batching="dynamic", max_batch_size=2, batch_window_ms=50)
    scheduler.add(make_seq("a", 2, max_tokens=3))
    assert run_step(scheduler).scheduled == []  # window open, batch not full
    time.sleep(0.06)
    assert [s.seq_id for s in run_step(scheduler).scheduled] == ["a"]
    scheduler.add(make_seq("b", 2, max_tokens=3))
    scheduler.add(make_seq("c", 2, max_tokens=3))
    while "a" in scheduler.seqs:  # newcomers wait while the batch runs
        assert {s.seq_id for s in run_step(scheduler).scheduled} == {"a"}
    assert {s.seq_id for s in run_step(scheduler).scheduled} == {"b", "c"}  # full batch: no wait


def test_kv_stats_report_usage_and_fragmentation():
    scheduler = make_scheduler(num_blocks=10)
    scheduler.add(make_seq("a", 5, max_tokens=10))
    run_step(scheduler)
    stats = scheduler.kv_stats()
    assert stats["kv_usage"] == pytest.approx(0.2)  # 2 of 10 blocks
    assert stats["kv_fragmentation"] == pytest.approx(3 / 8)  # 5 of 8 slots used


def test_metrics_are_computed_on_the_output_side_from_the_core_timestamps():
    times = RequestTimestamps(arrival=100.0, first_scheduled=100.5, first_token=101.0, finished=104.0)
    output = RequestOutput(
        "r",
        None,
        [1, 2],
        outputs=[CompletionOutput(0, "", [3, 4, 5, 6])],
        finished=True,
        timestamps=times,
        num_preemptions=1,
    )
    metrics = output.metrics
    assert (metrics.queue_time, metrics.ttft, metrics.e2e, metrics.tpot) == (0.5, 1.0, 4.0, 1.0)
    assert (metrics.num_prompt_tokens, metrics.num_output_tokens, metrics.num_preemptions) == (2, 4, 1)
    assert RequestOutput("r", None, [1], finished=False, timestamps=times).metrics is None


def sampled_ids(scheduler, plan):
    """Who a step just planned samples for (as the runner decides: the step reaches the
    sequence's last token, counting the one each earlier step in flight samples)."""

    def last(seq):
        return seq.num_tokens + seq.num_pending_samples - 1

    return [s.seq_id for s in plan.scheduled if s.num_computed + s.num_new == last(scheduler.seqs[s.seq_id])]


def test_overlapped_plan_counts_the_pending_token_and_skips_certain_ends():
    """Step 2 is planned before step 1's tokens are known: the decode of "a" starts at the
    position step 1 samples; "b" (max_tokens=1) ends with step 1's token, so it is left out."""
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", 5, max_tokens=4))
    scheduler.add(make_seq("b", 3, max_tokens=1))
    first = scheduler.schedule()
    first_sampled = sampled_ids(scheduler, first)
    second = scheduler.schedule()  # step 1 still in flight
    assert [(s.seq_id, s.num_computed, s.num_new) for s in second.scheduled] == [("a", 5, 1)]
    assert scheduler.seqs["a"].num_pending_samples == 2
    second_sampled = sampled_ids(scheduler, second)
    scheduler.update(first, StepResult(first_sampled, [7] * len(first_sampled)))
    scheduler.finish("b", "length")
    updated = scheduler.update(second, StepResult(second_sampled, [8]))
    [a] = updated
    assert a.output_token_ids == [7, 8] and a.num_computed_tokens == 6 and a.num_pending_samples == 0
    assert not scheduler.in_flight


def test_overlapped_step_of_a_sequence_that_ended_is_discarded():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", 5, max_tokens=10))
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.update(first, StepResult(["a"], [EOS]))
    scheduler.finish("a", "stop")  # the engine's stop check on step 1's token
    blocks_free = scheduler.block_manager.num_free_blocks
    assert scheduler.update(second, StepResult(["a"], [7])) == []  # the extra token is dropped
    assert scheduler.block_manager.num_free_blocks == blocks_free == scheduler.block_manager.num_blocks
    assert scheduler.schedule().finished_ids == ["a"]


def test_overlapped_plan_never_preempts_a_sequence_in_flight():
    """KV for one more token is missing while the only other sequence is in flight: the
    plan goes without, and the next plan (nothing in flight) preempts as usual."""
    scheduler = make_scheduler(num_blocks=4)  # 16 slots of 4 tokens
    scheduler.add(make_seq("a", 4, max_tokens=10))
    scheduler.add(make_seq("b", 8, max_tokens=10))
    first = scheduler.schedule()  # a: 1 block + b: 2 blocks (+1 kept free when admitting)
    assert {s.seq_id for s in first.scheduled} == {"a", "b"}
    second = scheduler.schedule()  # a takes the last block; b would need a victim: b, in flight
    assert [s.seq_id for s in second.scheduled] == ["a"] and second.preempted_ids == []
    scheduler.update(first, StepResult(["a", "b"], [7, 7]))
    scheduler.update(second, StepResult(["a"], [7]))
    third = scheduler.schedule()
    assert third.preempted_ids == ["b"] and [s.seq_id for s in third.scheduled] == ["a"]


def test_a_long_prefill_leaves_room_for_a_waiting_job_and_for_decodes():
    """Issue 39 item 13: a running chunked prefill took the whole budget, so a 1-token job
    waited for all of it (152 s behind 6,420 prompt tokens), and so did a decode ranked
    below it. While others wait, a prompt chunk takes at most half the budget; decodes go
    first; with nobody waiting the prefill keeps the whole budget."""
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64)
    scheduler.add(make_seq("decoding", 2, max_tokens=50))
    run_step(scheduler)  # its prompt; from now on it decodes
    scheduler.add(make_seq("long", 1000, max_tokens=1, priority=-1))  # ranks above the decode
    alone = run_step(scheduler)
    assert [(s.seq_id, s.num_new) for s in alone.scheduled] == [("decoding", 1), ("long", 63)]
    scheduler.add(make_seq("short", 3, max_tokens=1, priority_class="batch"))
    shared = run_step(scheduler)
    assert [(s.seq_id, s.num_new) for s in shared.scheduled] == [("decoding", 1), ("long", 32), ("short", 3)]
    assert "short" not in scheduler.seqs, "its one token came from that step"
    after = run_step(scheduler)
    assert [(s.seq_id, s.num_new) for s in after.scheduled] == [("decoding", 1), ("long", 63)]


def test_the_prefill_cap_follows_its_option():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64, long_prefill_token_threshold=0)
    scheduler.add(make_seq("long", 1000, max_tokens=1))
    run_step(scheduler)
    scheduler.add(make_seq("short", 3, max_tokens=1))
    assert [(s.seq_id, s.num_new) for s in run_step(scheduler).scheduled] == [("long", 64)]  # 0: no cap
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    scheduler.add(make_seq("long", 1000, max_tokens=1))
    run_step(scheduler)
    scheduler.add(make_seq("short", 3, max_tokens=1))
    assert [(s.seq_id, s.num_new) for s in run_step(scheduler).scheduled] == [("long", 16), ("short", 3)]


def test_several_long_prefills_together_leave_room_for_a_waiting_job():
    scheduler = make_scheduler(num_blocks=1024, max_num_batched_tokens=64)
    scheduler.add(make_seq("doc-a", 1000, max_tokens=1, priority_class="batch"))
    scheduler.add(make_seq("doc-b", 1000, max_tokens=1, priority_class="batch"))
    run_step(scheduler)
    assert [(s.seq_id, s.num_new) for s in run_step(scheduler).scheduled] == [("doc-a", 64)]
    scheduler.add(make_seq("chat", 5, max_tokens=1))
    shared = run_step(scheduler)
    # (the chat's first 4 tokens are doc-a's, a prefix-cache hit: 1 token left to compute)
    assert [(s.seq_id, s.num_new) for s in shared.scheduled] == [("doc-a", 32), ("chat", 1)]
    assert "chat" not in scheduler.seqs, "its one token came from that step"
