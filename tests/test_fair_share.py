"""Token-weighted fair share between tenants in the engine's admission (issue 41,
engine/fair_share.py), on the tiny model: a tenant that floods cannot take another's share,
shares weigh the split, an idle tenant banks no credit, and the stated bound holds."""

import pytest

from conveyor.engine import SamplingParams
from conveyor.engine.config import EngineConfig
from conveyor.engine.fair_share import FairShare, check_shares
from conveyor.engine.llm_engine import LLMEngine

PROMPT, OUTPUT, STEP_TOKENS = 24, 16, 64
# the bound the module states: one step's tokens plus one request's, over the smaller share
BOUND = STEP_TOKENS + PROMPT + OUTPUT


@pytest.fixture(scope="module")
def engine_of(tiny_model):
    made = []

    def make(**shares) -> LLMEngine:
        config = EngineConfig(
            model=tiny_model,
            device="cpu",
            max_num_seqs=4,
            max_num_batched_tokens=STEP_TOKENS,
            num_kv_blocks=256,
            enable_prefix_caching=False,
            tenant_shares=shares,
        )
        made.append(LLMEngine(config))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def submit(engine: LLMEngine, tenant: str, count: int, start: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    ids = []
    for n in range(start, start + count):
        seq = engine.make_sequence(f"{tenant}-{n}", [5 + (n + i) % 50 for i in range(PROMPT)], params)
        seq.tenant = tenant
        engine.add_sequence(seq)
        ids.append(seq.seq_id)
    return ids


class Run:
    """Steps an engine, recording each step's tokens per tenant and each request's finish step."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.fair = engine, engine.scheduler.fair
        self.steps: list[dict] = []  # per step: tokens served per tenant, counters, who is backlogged
        self.finished_at: dict[str, int] = {}

    def step(self) -> None:
        before = dict(self.fair.served)
        for output in self.engine.step():
            if output.finished:
                self.finished_at[output.request_id] = len(self.steps)
        served = {t: self.fair.served[t] - before.get(t, 0) for t in self.fair.served}
        self.steps.append({"served": served, "counters": dict(self.fair.counters), "active": dict(self.fair.active)})

    def until(self, done) -> None:
        for _ in range(5000):
            if done():
                return
            self.step()
        raise AssertionError("the engine did not get there in 5000 steps")

    def both_backlogged(self, a: str, b: str) -> list[dict]:
        return [s for s in self.steps if s["active"].get(a) and s["active"].get(b)]


def share_of(steps: list[dict], tenant: str) -> float:
    total = sum(sum(s["served"].values()) for s in steps)
    return sum(s["served"].get(tenant, 0) for s in steps) / total


def test_a_flood_does_not_take_the_other_tenants_share(engine_of):
    run = Run(engine_of())
    flood = submit(run.engine, "a", 60, 0)
    run.until(lambda: len(run.steps) >= 10)
    late = submit(run.engine, "b", 10, 0)
    run.until(lambda: all(i in run.finished_at for i in late))
    both = run.both_backlogged("a", "b")
    assert both and share_of(both, "b") >= 0.4, f"b got {share_of(both, 'b'):.2f} of the tokens"
    assert not all(i in run.finished_at for i in flood), "b's jobs finish before a's backlog drains"
    gap = max(abs(s["counters"]["a"] - s["counters"]["b"]) for s in both)
    assert gap <= BOUND, f"counters {gap:.0f} tokens apart, over the stated bound {BOUND}"
    print(f"\nb's share while both backlogged {share_of(both, 'b'):.2f}, largest counter gap {gap:.0f} <= {BOUND}")


def test_shares_weigh_the_split(engine_of):
    run = Run(engine_of(a=3))
    submit(run.engine, "a", 40, 0)
    submit(run.engine, "b", 40, 0)
    run.until(lambda: len(run.steps) >= 120)
    both = run.both_backlogged("a", "b")
    assert len(both) == 120
    assert 0.70 <= share_of(both[20:], "a") <= 0.80, f"a got {share_of(both[20:], 'a'):.2f}, share 3 of 4"
    weighted_gap = max(abs(s["counters"]["a"] - s["counters"]["b"]) for s in both)
    assert weighted_gap <= BOUND


def test_an_idle_tenant_banks_no_credit(engine_of):
    run = Run(engine_of())
    early = submit(run.engine, "b", 4, 0)
    run.until(lambda: all(i in run.finished_at for i in early))  # b served alone, then idle
    submit(run.engine, "a", 60, 0)
    run.until(lambda: run.fair.served["a"] > 1000)  # a far past b's counter
    back, idle_counter = len(run.steps), run.fair.counters["b"]
    submit(run.engine, "b", 20, 100)
    assert run.fair.counters["b"] == run.fair.counters["a"] > idle_counter + 800, "lifted to a's level"
    run.until(lambda: len(run.steps) >= back + 60)
    after = run.both_backlogged("a", "b")[-50:]
    assert 0.35 <= share_of(after, "b") <= 0.65, f"b got {share_of(after, 'b'):.2f} after coming back, not a burst"


def test_shares_are_validated_naming_the_tenant():
    assert check_shares("a=3, b=0.5") == {"a": 3.0, "b": 0.5}
    for bad, named in (("a=0", "'a'"), ("a", "'a'"), ({"": 1}, "''"), ({"x": True}, "'x'"), ("a=b", "a=b")):
        with pytest.raises(ValueError, match=named):
            check_shares(bad)
    assert FairShare().admission_order([]) == []


def test_each_tenant_keeps_its_own_rank_order():
    """Priority classes and priorities keep working inside each tenant: the interleaving only
    decides whose turn it is."""
    from conveyor.engine.sequence import Sequence

    def seq(name: str, tenant: str, prompt: int) -> Sequence:
        made = Sequence(name, [1] * prompt, SamplingParams(max_tokens=1), max_tokens=1)
        made.tenant = tenant
        return made

    fair = FairShare({"b": 2})
    ranked = [seq("a-urgent", "a", 10), seq("a-1", "a", 10), seq("b-urgent", "b", 10), seq("a-2", "a", 10)]
    ranked += [seq("b-1", "b", 10), seq("b-2", "b", 10)]
    order = [s.seq_id for s in fair.admission_order(ranked)]
    assert [i for i in order if i.startswith("a")] == ["a-urgent", "a-1", "a-2"]
    assert [i for i in order if i.startswith("b")] == ["b-urgent", "b-1", "b-2"]
    assert order[:3] == ["a-urgent", "b-urgent", "b-1"], "b's share of 2: two of its prompts per one of a's"


def test_a_tenant_with_only_running_work_is_lifted_when_it_queues_again():
    """Nothing waiting is "idle" for the lift, even with a sequence still running: a later burst
    starts level with the tenants that kept work waiting."""
    from conveyor.engine.sequence import Sequence

    def seq(tenant: str) -> Sequence:
        made = Sequence(f"{tenant}-x", [1] * 8, SamplingParams(max_tokens=1), max_tokens=1)
        made.tenant = tenant
        return made

    fair = FairShare()
    running_b, waiting_a = seq("b"), seq("a")
    fair.arrived(running_b)
    fair.admitted(running_b)  # b runs, nothing of b waits
    fair.arrived(waiting_a)
    fair.charge(waiting_a, 500)
    fair.charge(running_b, 10)
    fair.arrived(seq("b"))
    assert fair.counters["b"] == fair.counters["a"] == 500
    fair.finished(running_b, was_waiting=False)
    assert fair.active["b"] == 1 and fair.waiting["b"] == 1
