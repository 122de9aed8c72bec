"""A prefix cache that cannot be crossed (issue 41): blocks keyed by a sha256 chained over
their tokens from a root of the adapter and the cache salt, each hit checked against the
block's recorded parent and tokens; a replica salts every job with its namespace; every
result reports the prompt tokens it read from the cache (``usage.cached_tokens``, OpenAI's
``prompt_tokens_details.cached_tokens`` at the gateway)."""

import pytest
from replica_harness import ReplicaThread

from conveyor.actors.ingest import namespace_salt
from conveyor.clients import Client
from conveyor.clients.errors import InvalidJob
from conveyor.clients.protocol import JobRequest, payload_digest, validate_job
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.block_manager import BlockManager
from conveyor.engine.sequence import Sequence

BLOCK = 4
PYTHON_HASH_MODULUS = 2**61 - 1  # CPython hashes an int n as n mod this: n and n + it collide


def computed(manager: BlockManager, tokens: list[int], salt: str | None = None) -> Sequence:
    """A sequence whose prompt was computed and published to the cache, then freed."""
    seq = Sequence("s", list(tokens), SamplingParams(max_tokens=1), max_tokens=1)
    seq.cache_salt = salt
    manager.grow(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    manager.register_full_blocks(seq)
    manager.free(seq)
    return seq


def reused(manager: BlockManager, tokens: list[int], salt: str | None = None) -> int:
    seq = Sequence("t", list(tokens), SamplingParams(max_tokens=1), max_tokens=1)
    seq.cache_salt = salt
    hit = manager.reuse_cached_prefix(seq)
    manager.free(seq)
    return hit


def test_tokens_whose_tuple_hashes_collide_are_not_served_each_others_blocks():
    first = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    planted = [11 + PYTHON_HASH_MODULUS, 12, 13, 14, 15, 16, 17, 18, 19]
    assert hash((None, tuple(first[:BLOCK]))) == hash((None, tuple(planted[:BLOCK]))), "the old key collides"
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    computed(manager, first)
    assert reused(manager, first) == 2 * BLOCK, "the same tokens hit"
    assert reused(manager, planted) == 0, "a colliding block is not served"


def test_a_hit_is_checked_against_the_blocks_tokens():
    """Even a digest that matched would not serve a block holding other tokens."""
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    seq = computed(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    block = manager.cached[seq.block_hashes[0]]
    manager.block_content[block] = (manager.block_content[block][0], (1, 2, 3, 99))  # as if the digest collided
    assert reused(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_salts_never_share_blocks():
    manager = BlockManager(num_blocks=32, block_size=BLOCK)
    tokens = list(range(1, 14))
    computed(manager, tokens, salt=namespace_salt("a", None))
    assert reused(manager, tokens, salt=namespace_salt("a", None)) == 3 * BLOCK
    assert reused(manager, tokens, salt=namespace_salt("b", None)) == 0
    assert reused(manager, tokens, salt=namespace_salt("a", "x")) == 0
    assert reused(manager, tokens) == 0, "no salt is a salt of its own"
    # lengths first: no (namespace, salt) pair spells another's
    assert namespace_salt("a1", "x") != namespace_salt("a", "1x")


def test_the_offline_llm_takes_a_prompt_dicts_cache_salt(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kv_blocks=64, block_size=4, seed=0)
    try:
        prompt = list(range(5, 45))
        params = SamplingParams(temperature=0, max_tokens=4)
        a1, a2, b = (
            llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, params, use_tqdm=False)[0]
            for salt in ("a", "a", "b")
        )
        assert (a1.num_cached_tokens, b.num_cached_tokens) == (0, 0)
        assert a2.num_cached_tokens == 36, "the second prompt of salt a reads its full blocks from the cache"
        assert a1.outputs[0].token_ids == a2.outputs[0].token_ids == b.outputs[0].token_ids
        for hostile in ("x" * 257, "", 7, ["s"]):
            [refused] = llm.generate({"prompt_token_ids": prompt, "cache_salt": hostile}, params, use_tqdm=False)
            assert refused.outputs[0].finish_reason == "error" and "cache_salt" in refused.error, hostile
    finally:
        llm.close()


def test_cache_salt_is_a_bounded_job_field_in_the_digest_only_when_given():
    assert payload_digest(JobRequest(prompt="Hi")) == payload_digest(JobRequest(prompt="Hi", cache_salt=None))
    assert payload_digest(JobRequest(prompt="Hi")) != payload_digest(JobRequest(prompt="Hi", cache_salt="s"))
    for hostile in ("", "x" * 257, 7, ["s"], {"s": 1}):
        with pytest.raises(InvalidJob, match="cache_salt"):
            validate_job({"prompt": "Hi", "cache_salt": hostile})


def test_a_job_reports_the_prompt_tokens_it_read_from_the_cache(tiny_model, redis_url, namespace):
    with ReplicaThread(tiny_model, redis_url, namespace, max_num_seqs=4) as running:
        assert running.engine.scheduler.block_manager.enable_prefix_caching
        client = Client(redis_url, namespace=namespace)
        try:
            prompt = list(range(5, 200))
            params = dict(max_tokens=2, temperature=0)
            first = client.submit(prompt_token_ids=prompt, **params).result(timeout=60)
            second = client.submit(prompt_token_ids=prompt, **params).result(timeout=60)
            other = client.submit(prompt_token_ids=prompt, cache_salt="other", **params).result(timeout=60)
        finally:
            client.close()
    assert first.usage.cached_tokens == 0 and other.usage.cached_tokens == 0
    assert 0 < second.usage.cached_tokens < len(prompt)
    assert first.token_ids == second.token_ids == other.token_ids
