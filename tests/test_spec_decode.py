"""Speculative decoding by prompt lookup (engine/spec_decode/): the proposer, the options,
the scheduler's drafts and KV slots, and outputs that match the engine without drafts,
token for token (greedy, seeded) or in distribution (sampling), on tiny random models.

Random models rarely repeat themselves, so the real n-gram proposer's drafts are mostly
rejected on them (tests/test_exactness.py's ``speculative`` regime runs it anyway, and
tests/test_real_model.py runs it on SmolLM2, where they are accepted). To exercise long
accepted runs, rejections mid-way and stops inside a step, some tests here draft with
``ScriptedProposer`` instead: transformers' own greedy continuation, wrong on purpose now
and then. What is under test is what the engine does with drafts, whoever proposes them.
"""

import json
import math
import random
import re
from collections import Counter

import numpy as np
import pytest
import torch
from model_factory import VOCAB_SIZE, build_tiny_model, hf_greedy, mixed_max_tokens, mixed_prompts
from transformers import AutoModelForCausalLM

from conveyor.engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from conveyor.engine.finishing import StopRules
from conveyor.engine.plan import StepResult
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence
from conveyor.engine.spec_decode.config import SpeculativeConfig
from conveyor.engine.spec_decode.drafter import speculates
from conveyor.engine.spec_decode.ngram_proposer import NgramProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KV = "64MiB"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# --------------------------------------------------------------------------- proposer


def brute_force_drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: the longest n in [min_n, max_n] whose suffix n-gram ends earlier
    somewhere (before the last token); the k tokens after its most recent such occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_ngram_proposer_matches_the_definition():
    rng = random.Random(0)
    checked_hits = 0
    for _ in range(3000):
        alphabet = rng.choice([2, 3, 5, 20])  # small alphabets: many matches, overlaps, ties
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        expected = brute_force_drafts(tokens, min_n, max_n, k)
        assert NgramProposer(min_n, max_n).propose(np.array(tokens), k) == expected, (tokens, min_n, max_n, k)
        checked_hits += bool(expected)
    assert checked_hits > 1000


def test_ngram_proposer_examples():
    proposer = NgramProposer(2, 3)
    # vLLM's docstring example: [4, 2, 3] finds no earlier match, [2, 3] does
    assert proposer.propose(np.array([1, 2, 3, 4, 2, 3]), 4) == [4, 2, 3]
    assert proposer.propose(np.array([1, 2, 3, 9, 1, 2, 3, 8, 2, 3]), 2) == [8, 2]  # the most recent occurrence
    assert proposer.propose(np.array([7, 7, 7, 7]), 3) == [7]  # overlapping the suffix itself
    assert proposer.propose(np.array([1, 2, 3, 4]), 3) == []
    assert NgramProposer(1, 1).propose(np.array([5]), 3) == []


# --------------------------------------------------------------------------- options


def test_speculative_config_follows_vllm_defaults_and_checks():
    parse = SpeculativeConfig.parse
    assert parse(None) is None and parse("") is None
    both = parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert parse(json.dumps(NGRAM)) == SpeculativeConfig(**NGRAM)
    for bad, field in [
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("{not json", "JSON"),
        ("[1, 2]", "dict"),
    ]:
        with pytest.raises(ValueError, match=field):
            parse(bad)


def test_speculation_runs_steps_one_at_a_time_and_is_a_serve_flag(monkeypatch):
    import argparse

    from conveyor.actors import cli

    config = EngineConfig(model="x", speculative_config=NGRAM)
    assert config.async_scheduling is False  # the replica then keeps one step in flight
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="x", speculative_config=NGRAM, async_scheduling=True)
    parser = argparse.ArgumentParser()
    cli._add_engine_options(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    options = {name: value for name, value in vars(args).items() if value is not None}
    assert EngineConfig(model="x", **options).speculative_config == SpeculativeConfig(**NGRAM)
    monkeypatch.setenv("CONVEYOR_SPECULATIVE_CONFIG", json.dumps(NGRAM))
    assert EngineConfig(model="x").speculative_config.num_speculative_tokens == 4


def test_speculates_leaves_out_logprobs_and_structured_output_rows():
    assert speculates(SamplingParams(repetition_penalty=1.2, min_tokens=3, temperature=0.7))
    assert not speculates(SamplingParams(logprobs=0))
    assert not speculates(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))


# --------------------------------------------------------------------------- scheduler


def spec_scheduler(num_blocks=64, spec=None, **options):
    config = EngineConfig(
        model="unused",
        block_size=4,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
            **(spec or {}),
        },
        **options,
    )
    return Scheduler(config, num_blocks, StopRules({1}, max_model_len=1024))


def pattern(index: int) -> int:
    return 10 + index % 4


def repeating_seq(seq_id, prompt_len, max_tokens=20):
    """Tokens 10, 11, 12, 13, 10, ...: prompt lookup always drafts the pattern's next ones."""
    return Sequence(
        seq_id,
        [pattern(i) for i in range(prompt_len)],
        SamplingParams(temperature=0, max_tokens=max_tokens),
        max_tokens,
    )


def finish_step(scheduler, plan, accepted: dict[str, int] | None = None):
    """A fake model (the scheduler is under test): each sampling sequence accepts
    ``accepted[seq_id]`` of its drafts (default: all, then the pattern's next token as the
    bonus; else 99, the correction); applied as LLMEngine.postprocess does."""
    ids, first, extra = [], [], {}
    for item in plan.scheduled:
        seq = scheduler.seqs[item.seq_id]
        drafts = item.draft_token_ids
        if item.num_computed + item.num_new - len(drafts) != seq.num_tokens:
            continue  # a prefill chunk short of the prompt's end
        keep = drafts[: (accepted or {}).get(item.seq_id, len(drafts))]
        emitted = keep + [pattern(seq.num_tokens + len(keep)) if len(keep) == len(drafts) else 99]
        ids.append(item.seq_id)
        first.append(emitted[0])
        if emitted[1:]:
            extra[item.seq_id] = emitted[1:]
    for seq in scheduler.update(plan, StepResult(ids, first, extra_token_ids=extra)):
        for token_id in extra.get(seq.seq_id, ()):
            scheduler.append_token(seq, token_id)


def test_drafts_get_the_budget_the_step_leaves():
    scheduler = spec_scheduler(max_num_batched_tokens=8)
    scheduler.add(repeating_seq("running", 6))
    finish_step(scheduler, scheduler.schedule())  # prefill
    scheduler.add(Sequence("new", [50, 51, 52, 53, 54], SamplingParams(temperature=0, max_tokens=4), 4))
    plan = scheduler.schedule()
    # the decode and the whole new prompt first; the drafts get the 2 budget tokens left
    assert [(s.seq_id, s.num_new, s.draft_token_ids) for s in plan.scheduled] == [
        ("running", 3, [pattern(7), pattern(8)]),
        ("new", 5, []),
    ]
    assert plan.num_tokens == 8


def test_drafts_only_take_free_slots_and_never_preempt():
    scheduler = spec_scheduler(num_blocks=5)  # 20 slots of 4 tokens
    scheduler.add(repeating_seq("a", 7))  # 2 blocks
    scheduler.add(repeating_seq("b", 5))  # 2 blocks (1 is kept free when admitting)
    finish_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    # "a" ranks first: 4 drafts take the last free block; "b" fits 2 in its own last block
    assert [(s.seq_id, len(s.draft_token_ids)) for s in plan.scheduled] == [("a", 4), ("b", 2)]
    assert plan.preempted_ids == [] and scheduler.block_manager.num_free_blocks == 0
    finish_step(scheduler, plan)
    assert scheduler.seqs["a"].output_token_ids == [pattern(i) for i in range(7, 13)]


def test_no_drafts_in_steps_larger_than_disable_by_batch_size():
    scheduler = spec_scheduler(spec={"disable_by_batch_size": 1})
    scheduler.add(repeating_seq("a", 6))
    finish_step(scheduler, scheduler.schedule())
    assert scheduler.schedule().scheduled[0].draft_token_ids  # alone: drafts
    scheduler = spec_scheduler(spec={"disable_by_batch_size": 1})
    scheduler.add(repeating_seq("a", 6))
    scheduler.add(repeating_seq("b", 7))
    finish_step(scheduler, scheduler.schedule())
    assert [s.draft_token_ids for s in scheduler.schedule().scheduled] == [[], []]  # two: none


def test_rejected_drafts_give_their_blocks_back_and_the_runner_is_told():
    scheduler = spec_scheduler(num_blocks=16)
    manager = scheduler.block_manager
    seq = repeating_seq("a", 9)
    scheduler.add(seq)
    finish_step(scheduler, scheduler.schedule())  # 9 prompt tokens + 1: 3 blocks
    plan = scheduler.schedule()
    [item] = plan.scheduled
    assert (item.num_computed, item.num_new, item.draft_token_ids) == (9, 5, [pattern(i) for i in range(10, 14)])
    assert len(seq.block_table) == 4 and len(item.new_block_ids) == 1  # positions 9..13
    draft_block = seq.block_table[3]
    finish_step(scheduler, plan, {"a": 1})  # one accepted, then the correction: 12 tokens
    assert seq.token_ids[-3:] == [pattern(9), pattern(10), 99]
    assert seq.num_computed_tokens == 11 and len(seq.block_table) == 3
    assert seq.num_blocks_sent == 3 and scheduler.trimmed_tables == {"a": 3}
    assert manager.num_free_blocks == 16 - 3 and next(iter(manager.free_blocks)) == draft_block  # reused first
    assert manager.ref_counts[draft_block] == 0 and manager.block_hash[draft_block] is None
    # the prefix cache has the two blocks of computed tokens, hashed over their real tokens
    assert [manager.block_hash[b] for b in seq.block_table] == [
        manager._hash_of(seq, 0),
        manager._hash_of(seq, 1),
        None,
    ]
    assert scheduler.schedule().trimmed_tables == {"a": 3}  # the runner drops the block with the next plan
    stats = scheduler.drafter.stats()
    assert (
        stats["spec_decode_num_drafts"],
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    ) == (1, 4, 1)


def test_each_verified_position_sees_the_tokens_before_it():
    """Penalties and the min_tokens mask at draft position j count the drafts before j, as a
    step of its own would. Every position has the same logits (token 0 best, then 1, ...);
    a big frequency penalty makes greedy take the best token not yet output, and token 0
    (a stop id) is banned until 2 tokens are out: one step at a time that is 1, 2, 0, 3, 4."""
    from conveyor.engine.model_runner import RunnerSeq
    from conveyor.engine.sampler import Sampler
    from conveyor.engine.spec_decode.verifier import verify

    vocab, prompt = 50, [40, 41]
    params = SamplingParams(temperature=0, frequency_penalty=10.0, min_tokens=2, stop_token_ids=[0])
    logits = torch.linspace(5.0, 0.0, vocab).repeat(5, 1)
    for drafts, emitted in (([1, 2, 0, 3], [1, 2, 0, 3, 4]), ([1, 2, 9, 3], [1, 2, 0])):
        row = RunnerSeq(params, prompt + drafts, len(prompt), (0,), None)
        result = verify(Sampler(torch.device("cpu"), 0), logits, ["s"], [row], {"s": drafts})
        assert [result.token_ids[0], *result.extra_token_ids.get("s", [])] == emitted
        assert row.token_ids == prompt + emitted  # the rejected drafts are gone


# --------------------------------------------------------------------------- engine, scripted drafts


class ScriptedProposer:
    """Drafts the expected continuation of each known prompt (transformers' greedy output),
    with one token made wrong at a position that depends on the sequence's length: accepted
    runs of every length, rejections at every position, and bonus tokens all occur."""

    def __init__(self, continuations: dict[tuple, list[int]]):
        self.continuations = sorted(continuations.items(), key=lambda item: -len(item[0]))

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        tokens = tokens.tolist()
        for prompt, output in self.continuations:
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(output[done : done + k])
                wrong = (len(tokens) * 7919) % (k + 3)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % VOCAB_SIZE
                return drafts
        return []


def scripted(llm: LLM, prompts, outputs) -> LLM:
    llm.engine.scheduler.drafter.proposer = ScriptedProposer({tuple(p): o for p, o in zip(prompts, outputs)})
    return llm


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def arch_model(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(f"spec_{request.param}"))


@pytest.fixture(scope="module")
def greedy_workload(arch_model):
    prompts = mixed_prompts(VOCAB_SIZE, n=8, seed=3, min_len=1, max_len=90)
    max_tokens = mixed_max_tokens(8, seed=3, low=1, high=30)
    return prompts, max_tokens, [hf_greedy(arch_model, p, n, ignore_eos=True) for p, n in zip(prompts, max_tokens)]


@pytest.mark.parametrize(
    "regime",
    [
        {},
        dict(num_kv_blocks=40, block_size=4),  # preemption: 8 prompts up to 120 tokens in 160 slots
        dict(max_num_batched_tokens=16),  # chunked prefill; drafts get what the decodes leave
    ],
    ids=["ample_kv", "preemption", "chunked_prefill"],
)
def test_greedy_matches_transformers_with_accepted_drafts(arch_model, greedy_workload, regime):
    prompts, max_tokens, expected = greedy_workload
    llm = scripted(LLM(arch_model, speculative_config=NGRAM, **regime), prompts, expected)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert output.token_ids == want, f"request {output.request_id} differs"
    stats = llm.engine.stats()
    assert stats["spec_decode_acceptance_rate"] > 0.4 and stats["spec_decode_mean_acceptance_length"] > 2
    if "num_kv_blocks" in regime:
        assert stats["num_preemptions"] > 0
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    # the blocks published while speculating hold the right KV: prompts that extend into the
    # generated text hit them in the prefix cache and still decode exactly
    longer = [p + want[:20] for p, want in zip(prompts, expected) if len(p) + min(len(want), 20) >= 24]
    hits_before = manager.prefix_hits
    again = llm.generate(longer, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    if not regime:  # (a small pool may have evicted them by now)
        assert manager.prefix_hits - hits_before > sum(len(p) // 16 * 16 for p in prompts)
    for prompt, output in zip(longer, again):
        assert output.token_ids == hf_greedy(arch_model, prompt, 6, ignore_eos=True)


def stream(engine, prompts, params):
    """Drive ``engine.step()``; per request: its final output and the text after each step."""
    for index, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), prompt, param)
    finals, texts = {}, {str(i): [""] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(texts[out.request_id][-1] + out.new_text)
            if out.finished:
                finals[out.request_id] = out
    return [finals[str(i)] for i in range(len(prompts))], [texts[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("spec_llama"))


def test_structured_rows_beside_drafted_rows_keep_their_grammar(arch_model, greedy_workload):
    """A step with drafts verifies every row at once: a structured row in it (never drafted)
    is still masked and advanced by its grammar, and the drafted rows stay exact."""
    prompts, max_tokens, expected = greedy_workload
    llm = scripted(LLM(arch_model, speculative_config=NGRAM), prompts, expected)
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    structured = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="(ab|cd){2,5}")
    )
    outputs = llm.generate(prompts + prompts[:2], plain + [structured, structured], use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert output.token_ids == want, f"request {output.request_id} differs"
    for output in outputs[len(prompts) :]:
        assert output.finish_reason == "stop" and re.fullmatch("(ab|cd){2,5}", output.text), output.text
    assert llm.engine.stats()["spec_decode_acceptance_rate"] > 0.4


def test_every_stop_condition_applies_token_by_token(llama):
    """Stops inside a step's accepted run end the request at that token, as without drafts:
    stop strings (held-back text included), stop token ids, min_tokens, max_tokens,
    max_model_len; penalties apply at each verified position."""
    prompts = mixed_prompts(VOCAB_SIZE, n=6, seed=21, min_len=3, max_len=40)
    continuations = [hf_greedy(llama, p, 80 - len(p), ignore_eos=True) for p in prompts]
    plain = LLM(llama, max_model_len=80)
    tokenizer = plain.tokenizer
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in continuations]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[texts[0][len(texts[0]) // 2 :][:3]]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[continuations[1][9]]),
        SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[continuations[2][5]], min_tokens=11
        ),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),  # runs into max_model_len 80
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4, stop=["qqqzz"]
        ),
    ]
    reference, reference_texts = stream(plain.engine, prompts, params)
    spec = scripted(LLM(llama, max_model_len=80, speculative_config=NGRAM), prompts, continuations)
    outputs, streamed = stream(spec.engine, prompts, params)
    for want, got, snapshots in zip(reference, outputs, streamed):
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
        assert snapshots[-1] == got.text and all(got.text.startswith(s) for s in snapshots)
    assert [outputs[i].finish_reason for i in (0, 1, 3, 4)] == ["stop", "stop", "length", "length"]
    assert len(outputs[4].prompt_token_ids) + len(outputs[4].token_ids) == 80
    assert len(streamed[3]) < len(reference_texts[3])  # fewer steps: several tokens per step
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 40


# --------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def hf_llama(llama):
    return AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()


def probs_after(hf_model, ids):
    with torch.inference_mode():
        return torch.softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


@pytest.fixture(scope="module")
def drafted_prompt(hf_llama):
    """17 tokens ``A B C X Y f1..f9 A B C``: prompt lookup (3-grams) drafts ``X Y`` after it.
    X and Y are made the likeliest next tokens (a few rounds, as each changes the prompt),
    so that drafts are accepted about as often as rejected. 17 = one block of 16 + 1: once
    cached, each request starts with a single-token step, which is followed by drafts."""
    base = mixed_prompts(VOCAB_SIZE, n=1, seed=13, min_len=14, max_len=14)[0]
    prompt = lambda x, y: base[:3] + [x, y] + base[4:13] + base[:3]  # noqa: E731
    x, y = base[13], base[3]
    for _ in range(5):
        x = int(probs_after(hf_llama, prompt(x, y)).argmax())
        y = int(probs_after(hf_llama, prompt(x, y) + [x]).argmax())
    ids = prompt(x, y)
    assert len(ids) == 17 and len(set(ids[:14])) == 14
    assert NgramProposer(3, 3).propose(np.array(ids), 2) == [x, y]
    p = [probs_after(hf_llama, ids + [x, y][:i]) for i in range(3)]
    assert float(p[0][x]) > 0.3 and float(p[1][y]) > 0.15, "drafts should be accepted often enough to test"
    return ids, x, y, p


def chi_square_ok(samples: list[int], probs: torch.Tensor) -> tuple[float, float]:
    """Pearson chi-square of ``samples`` against ``probs`` over tokens with expected count
    >= 5 (the rest pooled), and its critical value at alpha = 1e-3 (Wilson-Hilferty)."""
    n, counts = len(samples), Counter(samples)
    head = [t for t in range(len(probs)) if probs[t] * n >= 5]
    expected = [float(probs[t]) * n for t in head]
    observed = [counts.get(t, 0) for t in head]
    if n - sum(expected) >= 5:
        expected.append(n - sum(expected))
        observed.append(n - sum(observed))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(expected) - 1
    a = 2.0 / (9.0 * df)
    return chi2, df * (1.0 - a + 3.0902 * math.sqrt(a)) ** 3


def test_rejection_sampling_keeps_the_target_distribution(llama, drafted_prompt):
    """3000 draws through steps that verify the drafts X, Y: the first token must follow p
    (X accepted with probability p(X), else a draw from the rest), the second given X must
    follow p after X (Y accepted or not), the third given X Y (the bonus token) likewise."""
    ids, x, y, p = drafted_prompt
    engine = LLM(
        llama,
        kv_cache_memory=KV,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        seed=42,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 3,
            "prompt_lookup_max": 3,
        },
    )
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    engine.generate([ids], params, use_tqdm=False)  # caches the prompt's first block
    outs = engine.generate([ids] * 3000, params, use_tqdm=False)
    stats = engine.engine.stats()
    assert stats["spec_decode_num_drafts"] >= 3000  # every request's first step verified X, Y
    firsts = [o.token_ids[0] for o in outs]
    seconds = [o.token_ids[1] for o in outs if o.token_ids[0] == x]
    thirds = [o.token_ids[2] for o in outs if o.token_ids[:2] == [x, y]]
    assert len(thirds) > 300
    for samples, probs in ((firsts, p[0]), (seconds, p[1]), (thirds, p[2])):
        chi2, critical = chi_square_ok(samples, probs)
        assert chi2 < critical, (len(samples), chi2, critical)
    # and a verifier that always (or never) accepted would be far off: X's share is p(X)
    assert abs(firsts.count(x) / 3000 - float(p[0][x])) < 0.04


def test_seeded_sampling_is_the_same_with_and_without_drafts(llama, drafted_prompt):
    """A seeded row draws its noise per emitted token, drafts or not: the same tokens with
    speculation on and off, alone or in a batch."""
    ids, _, _, _ = drafted_prompt
    spec_options = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    plain = LLM(llama, kv_cache_memory=KV, seed=1)
    spec = LLM(llama, kv_cache_memory=KV, seed=2, speculative_config=spec_options)
    seeded = [
        SamplingParams(
            temperature=0.9,
            top_k=50,
            max_tokens=12,
            ignore_eos=True,
            seed=s,
            repetition_penalty=1.1 if s % 3 == 0 else 1.0,
        )
        for s in range(24)
    ]
    spec.generate([ids], seeded[0], use_tqdm=False)  # cached: later requests draft from their first step
    want = plain.generate([ids] * 24, seeded, use_tqdm=False)
    alone = [spec.generate([ids], s, use_tqdm=False)[0] for s in seeded[:6]]
    batch = spec.generate(
        [ids] * 24 + mixed_prompts(VOCAB_SIZE, n=6, seed=4, min_len=3, max_len=30),
        seeded + [SamplingParams(temperature=1.0, max_tokens=10)] * 6,
        use_tqdm=False,
    )
    assert [o.token_ids for o in batch[:24]] == [o.token_ids for o in want]
    assert [o.token_ids for o in alone] == [o.token_ids for o in want[:6]]
    assert len({tuple(o.token_ids) for o in want}) > 12  # the seeds really differ
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 10  # accepted runs were drawn too


# --------------------------------------------------------------------------- replica


def test_replica_speculates_and_reports_acceptance(llama, redis_url, namespace):
    """Through Redis: the same tokens and text as the engine without drafts, one step at a
    time, and the acceptance counters on the replica's metrics."""
    from replica_harness import ReplicaThread

    from conveyor.clients import Client

    prompts = mixed_prompts(VOCAB_SIZE, n=5, seed=8, min_len=3, max_len=40)
    continuations = [hf_greedy(llama, p, 24, ignore_eos=True) for p in prompts]
    reference = LLM(llama).generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    with ReplicaThread(llama, redis_url, namespace, speculative_config=json.dumps(NGRAM)) as running:
        assert not running.engine.overlaps_steps  # one step at a time: the drafter sees the latest tokens
        scripted_drafts = ScriptedProposer({tuple(p): c for p, c in zip(prompts, continuations)})
        running.engine.scheduler.drafter.proposer = scripted_drafts
        client = Client(redis_url, namespace=namespace)
        jobs = [client.submit(prompt_token_ids=p, max_tokens=24, ignore_eos=True, temperature=0) for p in prompts]
        results = [job.result(timeout=60) for job in jobs]
        streamed = ["".join(event.text for event in job.stream(timeout=10)) for job in jobs]
        registry = running.replica.metrics.registry
        drafted = registry.get_sample_value("conveyor_spec_decode_num_draft_tokens_total")
        accepted = registry.get_sample_value("conveyor_spec_decode_num_accepted_tokens_total")
        rate = registry.get_sample_value("conveyor_spec_decode_acceptance_rate")
    for result, want, text in zip(results, reference, streamed):
        assert result.token_ids == want.token_ids and result.text == want.text == text
    assert drafted > 0 and 0 < accepted <= drafted and rate == pytest.approx(accepted / drafted)
