"""CUDA graphs for decode (engine/cuda_graphs.py) on CPU: bucket choice, padding and the
static-buffer updates, and the runner serving decode steps through them with the replay
done eagerly (only the capture itself needs a GPU), under Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from model_factory import build_tiny_model, hf_greedy, mixed_prompts  # noqa: E402

from conveyor.engine import LLM, SamplingParams  # noqa: E402
from conveyor.engine.attention_metadata import AttentionMetadata  # noqa: E402
from conveyor.engine.cuda_graphs import DecodeBuffers, DecodeGraphs, bucket_for, graph_buckets  # noqa: E402


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = graph_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 17, 64, 65)] == [1, 4, 8, 16, 24, 64, None]


def decode_meta(slots, tables, lens):
    return AttentionMetadata(torch.tensor(slots), len(slots), torch.tensor(tables), torch.tensor(lens))


def test_buffers_take_the_rows_and_pad_the_rest_of_the_bucket():
    buffers = DecodeBuffers.allocate(8, 4, torch.device("cpu"))
    buffers.load(
        torch.tensor([5, 6, 7, 8, 9]),
        torch.tensor([3, 4, 5, 6, 7]),
        decode_meta([10, 11, 12, 13, 14], [[1, 2]] * 5, [4, 5, 6, 7, 8]),
        bucket=8,
    )
    buffers.load(
        torch.tensor([21, 22]),
        torch.tensor([40, 41]),
        decode_meta([70, 71], [[3, 4, 5], [6, 7, 8]], [41, 42]),
        bucket=4,
    )
    assert buffers.input_ids[:4].tolist() == [21, 22, 0, 0]
    assert buffers.positions[:4].tolist() == [40, 41, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [70, 71, -1, -1]  # padded rows write nothing
    assert buffers.context_lens[:4].tolist() == [41, 42, 0, 0]  # and attend to nothing
    assert buffers.block_tables[:2, :3].tolist() == [[3, 4, 5], [6, 7, 8]]
    meta = buffers.meta(4)
    assert meta.num_decode_tokens == 4 and meta.decode_block_tables.shape == (4, 4)
    assert meta.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()  # the static storage itself


def test_runner_decodes_through_the_graph_buffers_token_identical(tmp_path):
    """Buckets (2, 4): five sequences run eagerly, four or three replay bucket 4 (three
    padded), two or one bucket 2; greedy output equals transformers'."""
    model = build_tiny_model("llama", tmp_path / "llama")
    prompts = mixed_prompts(768, n=5, seed=31, min_len=3, max_len=30)
    max_tokens = [2, 3, 4, 6, 7]
    llm = LLM(model, attention_backend="triton", num_kv_blocks=48)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: nothing captured
    runner.graphs = graphs = DecodeGraphs(
        runner.model, [2, 4], -(-runner.max_model_len // runner.block_size), runner.device
    )
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens], use_tqdm=False)
    for prompt, n, output in zip(prompts, max_tokens, outputs):
        assert output.token_ids == hf_greedy(model, prompt, n)
    assert graphs.replays >= 5 and not graphs.graphs
