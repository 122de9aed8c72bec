"""Sampling semantics of the engine, checked against transformers' own logits.

Everything runs on a tiny random Llama (tests/model_factory.py). Reference distributions
come from one transformers forward pass; the engine is only ever compared with them,
never with itself, except where batch-invariance is the property under test.
"""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_factory, however pytest is run

from model_factory import VOCAB_SIZE, build_tiny_model, hf_greedy, mixed_prompts  # noqa: E402

from conveyor.engine import LLM, SamplingParams  # noqa: E402

KV = "64MiB"  # KV cache pool per engine: plenty for the tiny model, far below the 1 GiB default


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("sampling_llama"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, kv_cache_memory=KV, max_num_seqs=256, max_num_batched_tokens=2048, seed=0)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(VOCAB_SIZE, n=12, seed=11, min_len=3, max_len=40)


def next_token_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits for the token after ``ids``."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def all_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """Logits after every prefix of ``ids`` ([len(ids), V]; row i predicts ids[i + 1])."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# --------------------------------------------------------------------------- seeds


def test_seeded_request_is_batch_invariant(model_dir, llm, prompts):
    target = prompts[3]
    seeded = SamplingParams(seed=1234, temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)

    alone = llm.generate([target], seeded, use_tqdm=False)[0].token_ids
    assert len(alone) == 20

    # position 0 of a batch of 9: eight random neighbours (unseeded, greedy, other seeds, top-k)
    rng = random.Random(5)
    neighbours = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.3]),
            top_k=rng.choice([0, 5, 50]),
            max_tokens=rng.randint(1, 30),
            seed=rng.choice([None, 7, 99]),
        )
        for _ in range(8)
    ]
    batch = llm.generate([target] + prompts[4:12], [seeded] + neighbours, use_tqdm=False)
    assert batch[0].token_ids == alone

    # another engine (other global seed), tiny step budget: chunked prefill, a different step mix,
    # the target at position 5 among other neighbours, and a KV pool small enough to preempt
    small = LLM(model_dir, num_kv_blocks=8, max_num_seqs=3, max_num_batched_tokens=16, seed=123)
    others = prompts[:3] + prompts[5:10]
    mixed = others[:5] + [target] + others[5:]
    params = [
        SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True, seed=s) for s in (None, 1, None, 1234, None)
    ]
    params += [seeded] + [SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)] * 3
    outs = small.generate(mixed, params, use_tqdm=False)
    assert outs[5].token_ids == alone
    assert small.engine.scheduler.num_preemptions > 0  # the step mix really was different

    # the seed decides: another seed gives other tokens, and the draw is not plain greedy
    other_seed = SamplingParams(seed=1235, temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].token_ids != alone
    assert alone != hf_greedy(model_dir, target, 20, ignore_eos=True)


def test_tiny_temperature_is_greedy(model_dir, llm, prompts):
    params = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompts[2]], params, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(model_dir, prompts[2], 8, ignore_eos=True)


def test_small_temperature_is_greedy(model_dir, llm, prompts):
    params = SamplingParams(temperature=1e-6, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts[:4], params, use_tqdm=False)
    for prompt, out in zip(prompts[:4], outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 8, ignore_eos=True)


def test_top_k_1_equals_greedy(model_dir, llm, prompts):
    chosen = prompts[:6]
    as_greedy = llm.generate(chosen, greedy(12), use_tqdm=False)
    # top_k=1 at temperature 1, sharing the batch with real sampling rows
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(chosen + chosen, [top1] * 6 + [sampled] * 6, use_tqdm=False)
    for prompt, g, o in zip(chosen, as_greedy, outs[:6]):
        assert o.token_ids == g.token_ids == hf_greedy(model_dir, prompt, 12, ignore_eos=True)


# --------------------------------------------------------------------------- distributions


def _bucketed(probs: torch.Tensor, counts: Counter, n: int, min_prob: float):
    """Tokens with p >= min_prob each get a bucket; all others share a tail bucket."""
    head = [t for t in range(len(probs)) if probs[t] >= min_prob]
    expected = [float(probs[t]) for t in head]
    observed = [counts.get(t, 0) / n for t in head]
    expected.append(max(0.0, 1.0 - sum(expected)))
    observed.append(1.0 - sum(observed))
    return expected, observed


def _chi2_critical(df: int, z: float) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at standard-normal quantile z."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_temperature_sampling_matches_softmax(model_dir, hf_model, prompts, temperature):
    """N single-token draws (no seeds, one generate call) against p = softmax(logits / T).

    Two deterministic checks (the engine's global seed is fixed, so the draws are too):
    * total variation over buckets (p >= 0.01 each, plus one tail bucket). For multinomial
      frequencies E|f_b - p_b| <= sqrt(p_b (1 - p_b) / N), so E[TV] <= 1/2 sum_b of that;
      one draw moves TV by at most 1/N, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 N t^2),
      and t = sqrt(ln(1e4) / 2N) makes a false failure a 1e-4 event. The bound is computed
      from p itself; for this model it comes to ~0.07 at N = 3000, while softmax at the
      other temperature is ~0.27 away (checked, so the test can tell temperatures apart).
    * Pearson chi-square over buckets with expected count >= 5, rejected at alpha = 1e-3.
    """
    n = 3000
    prompt = prompts[0][:6]
    logits = next_token_logits(hf_model, prompt)
    p = torch.softmax(logits / temperature, dim=-1)
    other = torch.softmax(logits / (1.0 if temperature != 1.0 else 0.7), dim=-1)

    engine = LLM(model_dir, kv_cache_memory=KV, max_num_seqs=1024, max_num_batched_tokens=8192, seed=42)
    params = SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True)
    outs = engine.generate([prompt] * n, params, use_tqdm=False)
    assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in outs)
    counts = Counter(o.token_ids[0] for o in outs)

    expected, observed = _bucketed(p, counts, n, 0.01)
    tv = 0.5 * sum(abs(e - o) for e, o in zip(expected, observed))
    tolerance = 0.5 * sum(math.sqrt(e * (1 - e) / n) for e in expected) + math.sqrt(math.log(1e4) / (2 * n))
    assert tolerance < 0.15, "the bound must be tight enough to mean something"
    # the same buckets, against the other temperature's softmax
    head = [t for t in range(len(p)) if p[t] >= 0.01]
    tv_other = 0.5 * (
        sum(abs(float(other[t]) - counts.get(t, 0) / n) for t in head)
        + abs((1 - sum(float(other[t]) for t in head)) - observed[-1])
    )
    print(f"T={temperature}: TV {tv:.4f} tolerance {tolerance:.4f} TV to other T {tv_other:.4f}")
    assert tv < tolerance, f"TV {tv:.4f} >= {tolerance:.4f}"
    assert tv_other > tolerance, "the other temperature's softmax should be rejected"

    # chi-square: each token with expected count >= 5, the rest pooled
    head5 = [t for t in range(len(p)) if p[t] * n >= 5]
    exp_counts = [float(p[t]) * n for t in head5]
    obs_counts = [counts.get(t, 0) for t in head5]
    tail_exp, tail_obs = n - sum(exp_counts), n - sum(obs_counts)
    if tail_exp >= 5:
        exp_counts.append(tail_exp)
        obs_counts.append(tail_obs)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs_counts, exp_counts))
    critical = _chi2_critical(len(exp_counts) - 1, z=3.0902)  # alpha = 1e-3
    print(f"chi2 {chi2:.1f} critical {critical:.1f} df {len(exp_counts) - 1}")
    assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical:.1f} (df {len(exp_counts) - 1})"


def _top_p_cut(probs: torch.Tensor, keep: int) -> float:
    """A top_p that keeps exactly ``keep`` tokens, midway between the two cumulative masses
    (token i survives when the mass before it is < top_p), far from float-noise ties."""
    cum = probs.sort(descending=True).values.cumsum(0)
    return float((cum[keep - 2] + cum[keep - 1]) / 2)


def test_top_k_top_p_min_p_restrict_support(model_dir, hf_model, prompts):
    prompt = prompts[1][:8]
    logits = next_token_logits(hf_model, prompt)
    order = logits.argsort(descending=True).tolist()
    p1 = torch.softmax(logits, -1)
    p08 = torch.softmax(logits / 0.8, -1)

    cases = []  # (params, allowed set, renormalised probabilities over it)
    k = 6
    cases.append((SamplingParams(temperature=1.0, top_k=k), set(order[:k])))
    keep = 5  # top_p on the temperature-scaled distribution (temperature applies first)
    cases.append((SamplingParams(temperature=0.8, top_p=_top_p_cut(p08, keep)), set(order[:keep])))
    ratios = (p1[order] / p1[order[0]]).tolist()
    keep = 7  # min_p midway between the 7th and 8th token's ratio to the top one
    min_p = (ratios[keep - 1] + ratios[keep]) / 2
    cases.append((SamplingParams(temperature=1.0, min_p=min_p), set(order[:keep])))
    # top_k then top_p on the renormalised top-k distribution (vLLM / transformers order)
    p_top4 = torch.softmax(logits[order[:4]], -1)
    cases.append((SamplingParams(temperature=1.0, top_k=4, top_p=_top_p_cut(p_top4, 3)), set(order[:3])))

    n = 300
    engine = LLM(model_dir, kv_cache_memory=KV, max_num_seqs=1024, max_num_batched_tokens=8192, seed=3)
    all_params = []
    for params, _ in cases:
        params.max_tokens, params.ignore_eos = 1, True
        all_params += [params] * n
    outs = engine.generate([prompt] * len(all_params), all_params, use_tqdm=False)
    for index, (params, allowed) in enumerate(cases):
        drawn = Counter(o.token_ids[0] for o in outs[index * n : (index + 1) * n])
        assert set(drawn) <= allowed, (params, set(drawn) - allowed)
        # and nothing inside the set is cut: a token of renormalised mass >= 5 % is missed
        # by 300 draws with probability <= 0.95**300 ~ 2e-7
        base = p08 if params.temperature == 0.8 else p1
        mass = sum(float(base[t]) for t in allowed)
        for token in allowed:
            if float(base[token]) / mass >= 0.05:
                assert drawn[token] > 0, (params, token)


# --------------------------------------------------------------------------- stop conditions


def _piece_boundaries(tokenizer, token_ids: list[int], text: str) -> list[int]:
    """Character offset in ``text`` after each output token, where decoding is clean."""
    offsets = []
    for i in range(1, len(token_ids) + 1):
        prefix = tokenizer.decode(token_ids[:i], skip_special_tokens=True)
        offsets.append(len(prefix) if text.startswith(prefix) and "\ufffd" not in prefix else -1)
    return offsets


def _spanning_stop(tokenizer, token_ids, text) -> tuple[str, int, int]:
    """A 4-char stop string made of the end of one token's text and the start of the next,
    occurring first at that boundary. Returns (stop, its index in text, tokens to complete it)."""
    ends = _piece_boundaries(tokenizer, token_ids, text)
    for i in range(1, len(token_ids) - 1):
        start, boundary, end = ends[i - 1], ends[i], ends[i + 1]
        if min(start, boundary, end) < 0 or boundary - start < 2 or end - boundary < 2:
            continue
        stop = text[boundary - 2 : boundary + 2]
        if stop.isprintable() and text.find(stop) == boundary - 2:
            return stop, boundary - 2, i + 2
    raise AssertionError("no usable token boundary in the greedy text")


@pytest.fixture(scope="module")
def greedy_run(llm, prompts):
    """A greedy 30-token output whose text is long enough to cut."""
    for prompt in prompts:
        out = llm.generate([prompt], greedy(30), use_tqdm=False)[0]
        try:
            stop, index, n_tokens = _spanning_stop(llm.tokenizer, out.token_ids, out.text)
        except AssertionError:
            continue
        return prompt, out, stop, index, n_tokens
    raise AssertionError("no prompt gave a usable greedy text")


def test_stop_string_spanning_tokens_is_cut(llm, greedy_run):
    prompt, ref, stop, index, n_tokens = greedy_run
    assert ref.text == llm.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    out = llm.generate([prompt], greedy(30, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:index]
    assert stop not in out.text
    assert out.token_ids == ref.token_ids[:n_tokens]  # up to the token that completed it

    # two stop strings: the one that appears first in the text wins, whatever the list order
    later = ref.text[-3:]
    if ref.text.find(later) > index:
        out2 = llm.generate([prompt], greedy(30, stop=[later, stop]), use_tqdm=False)[0]
        assert out2.stop_reason == stop and out2.text == ref.text[:index]


def test_stop_string_never_generated_changes_nothing(llm, greedy_run):
    prompt, ref, stop, _, _ = greedy_run
    never = stop + "\x00never"  # starts like a real one: held back, then released
    out = llm.generate([prompt], greedy(30, stop=[never, "qqqqzzzz"]), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == ref.token_ids and out.text == ref.text


def _stream(engine, request_id, prompt, params):
    """Drive ``engine.step()`` by hand; returns (final output, text emitted after each step)."""
    engine.add_request(request_id, prompt, params)
    emitted, snapshots, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            emitted += out.new_text
            snapshots.append(emitted)
            if out.finished:
                final = out
    return final, snapshots


@pytest.mark.parametrize("kind", ["cut", "never"])
def test_stop_string_deltas(llm, greedy_run, kind):
    prompt, ref, stop, index, n_tokens = greedy_run
    stops = [stop] if kind == "cut" else [stop + "\x00never"]
    final, snapshots = _stream(llm.engine, f"stream-{kind}", prompt, greedy(30, stop=stops))
    assert final is not None and final.finished
    expected = ref.text[:index] if kind == "cut" else ref.text
    assert final.text == expected
    assert snapshots[-1] == expected  # the deltas add up to the final text
    for snapshot in snapshots:  # and never hand out text that a stop string later cuts
        assert expected.startswith(snapshot), (snapshot, expected)
    # one token per step: after the token whose text ends with the stop string's first half,
    # exactly the text before that half is out (the half is held back until ruled out or cut)
    assert snapshots[n_tokens - 2] == ref.text[:index]
    if kind == "never":
        assert snapshots[n_tokens - 1].startswith(ref.text[: index + 4])  # released


def test_text_matches_tokenizer_decode(llm):
    """The incremental detokenizer agrees with decoding all output ids at once (random byte
    tokens include broken UTF-8). A character still incomplete when the request ends is
    dropped, so only a trailing U+FFFD may differ."""
    prompts = mixed_prompts(VOCAB_SIZE, n=40, seed=11, min_len=3, max_len=40)
    outs = llm.generate(
        prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    for out in outs:
        full = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.text == full or (full.startswith(out.text) and set(full[len(out.text) :]) == {"\ufffd"})
    assert sum(out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outs) >= 30


def test_stop_token_ids(llm, prompts):
    prompt = prompts[2]
    ref = llm.generate([prompt], greedy(30), use_tqdm=False)[0].token_ids
    position = next(i for i in range(3, 30) if ref[i] not in ref[:i])
    stop_id = ref[position]
    out = llm.generate([prompt], greedy(30, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == ref[: position + 1]

    # min_tokens: the stop id is banned until min_tokens outputs exist, so no early stop
    min_tokens = position + 3
    out = llm.generate([prompt], greedy(30, stop_token_ids=[stop_id], min_tokens=min_tokens), use_tqdm=False)[0]
    assert len(out.token_ids) >= min_tokens
    assert stop_id not in out.token_ids[:min_tokens]
    assert out.token_ids[:position] == ref[:position]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_id and out.stop_reason == stop_id
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 30


def test_max_tokens_gives_length(llm, prompts):
    sizes = [1, 2, 7, 13]
    outs = llm.generate(prompts[:4], [greedy(n) for n in sizes], use_tqdm=False)
    for n, out in zip(sizes, outs):
        assert out.finish_reason == "length" and out.stop_reason is None
        assert len(out.token_ids) == n and out.metrics.num_output_tokens == n


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, model_dir, prompts):
    """The same tiny weights, with generation_config's EOS set to a token greedy reaches at
    output position 4 for ``prompts[0]`` (a random model almost never picks the real EOS)."""
    import json

    out_dir = tmp_path_factory.mktemp("eos_llama")
    build_tiny_model("llama", out_dir)
    ref = hf_greedy(model_dir, prompts[0], 20, ignore_eos=True)
    eos = next(ref[i] for i in range(4, 20) if ref[i] not in ref[:i])
    first = ref.index(eos)
    gen = json.loads((out_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return str(out_dir), eos, first, ref


def test_eos_stops_unless_ignored(eos_model, prompts):
    model, eos, first, ref = eos_model
    engine = LLM(model, kv_cache_memory=KV, seed=0)
    prompt = prompts[0]
    stops, ignores, late = engine.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0, max_tokens=20),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 3),
        ],
        use_tqdm=False,
    )
    assert stops.finish_reason == "stop" and stops.stop_reason is None
    assert stops.token_ids == ref[: first + 1] == hf_greedy(model, prompt, 20)
    assert ignores.finish_reason == "length" and ignores.token_ids == ref
    assert len(late.token_ids) >= first + 3 and eos not in late.token_ids[: first + 3]
    assert late.token_ids[:first] == ref[:first]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_greedy_match_transformers(llm, hf_model, prompts):
    """vLLM's shape: per position {token id: Logprob(logprob, rank, decoded_token)}, the
    sampled token first, then the top ones with ranks 1, 2, ..."""
    prompt = prompts[4][:20]
    out = llm.generate([prompt], greedy(8, logprobs=3), use_tqdm=False)[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    ref = all_logits(hf_model, prompt + out.token_ids).log_softmax(-1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert list(entry) == top.indices.tolist() and list(entry)[0] == token  # greedy: the best one
        assert [entry[t].rank for t in entry] == [1, 2, 3]
        assert [entry[t].logprob for t in entry] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert all(entry[t].decoded_token == llm.get_tokenizer().decode([t]) for t in entry)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


def test_logprobs_sampled_and_zero(llm, hf_model, prompts):
    prompt = prompts[5][:10]
    sampled, bare = llm.generate(
        [prompt, prompt],
        [SamplingParams(temperature=1.0, seed=9, max_tokens=5, ignore_eos=True, logprobs=2), greedy(3, logprobs=0)],
        use_tqdm=False,
    )
    ref = all_logits(hf_model, prompt + sampled.token_ids).log_softmax(-1)
    for i, (token, entry) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert list(entry)[0] == token and len(entry) in (2, 3)  # the sampled token, with the top 2
        # the chosen token's (raw, unscaled) logprob and vocabulary rank, in the top list or not
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
    assert all(list(e) == [t] and e[t].rank == 1 for e, t in zip(bare.logprobs, bare.token_ids))
    # no logprobs asked: none returned
    plain = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


# --------------------------------------------------------------------------- penalties


def _penalised_greedy(hf_model, prompt, n, repetition=1.0, presence=0.0, frequency=0.0):
    """Greedy decoding by full re-forward, with the OpenAI/vLLM penalties applied by hand:
    repetition on every token seen in prompt or output (divide positive logits, multiply
    negative ones), presence/frequency on output tokens only."""
    ids = list(prompt)
    for _ in range(n):
        logits = next_token_logits(hf_model, ids).clone()
        output = ids[len(prompt) :]
        for token in set(ids):
            value = float(logits[token])
            logits[token] = value / repetition if value > 0 else value * repetition
        for token, count in Counter(output).items():
            logits[token] -= frequency * count + presence
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _repeats(tokens, prompt=()):
    """Output tokens already seen earlier in the output (or in ``prompt``, when given)."""
    return sum(1 for i, t in enumerate(tokens) if t in tokens[:i] or t in prompt)


@pytest.fixture(scope="module")
def repetitive(model_dir):
    """A prompt whose plain greedy output repeats itself (253 eight times in a row), picked
    once from 40 random prompts of this seed."""
    prompt = mixed_prompts(VOCAB_SIZE, n=40, seed=21, min_len=3, max_len=24)[5]
    plain = hf_greedy(model_dir, prompt, 32, ignore_eos=True)
    assert _repeats(plain) >= 6
    return prompt, plain


@pytest.mark.parametrize(
    "penalty",
    [
        dict(repetition_penalty=2.0),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    ],
)
def test_penalties_match_hand_computed_and_reduce_repeats(llm, hf_model, repetitive, penalty):
    prompt, plain = repetitive
    n = len(plain)
    expected = _penalised_greedy(
        hf_model,
        prompt,
        n,
        penalty.get("repetition_penalty", 1.0),
        penalty.get("presence_penalty", 0.0),
        penalty.get("frequency_penalty", 0.0),
    )
    # penalised and plain rows share one batch
    out, same = llm.generate([prompt, prompt], [greedy(n, **penalty), greedy(n)], use_tqdm=False)
    assert same.token_ids == plain
    assert out.token_ids == expected
    assert out.token_ids != plain
    # the expected direction: repetition counts prompt tokens too, the others only the output
    if "repetition_penalty" in penalty:
        assert _repeats(out.token_ids, prompt) < _repeats(plain, prompt)
    if "presence_penalty" in penalty or "frequency_penalty" in penalty:
        assert _repeats(out.token_ids) < _repeats(plain)


def test_negative_presence_penalty_encourages_repeats(llm, hf_model, repetitive):
    prompt, plain = repetitive
    expected = _penalised_greedy(hf_model, prompt, len(plain), presence=-2.0)
    out = llm.generate([prompt], greedy(len(plain), presence_penalty=-2.0), use_tqdm=False)[0]
    assert out.token_ids == expected
    assert _repeats(out.token_ids) > _repeats(plain)
