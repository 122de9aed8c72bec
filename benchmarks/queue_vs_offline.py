"""The offline workload through Redis + actors vs the offline ``LLM``, same run.

    python benchmarks/queue_vs_offline.py [--model smollm2] [--num-requests 32]

Starts an embedded Valkey and one ``conveyor serve`` replica (a separate process, as in
production), submits the workload of benchmarks/offline.py through the client, waits
for every result, then runs the same workload through the offline LLM in this process.
Prints output tokens/s of each and the ratio (target: queue >= 0.9 x offline).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import make_workload, run_ours  # noqa: E402


def run_queue(model: str, prompts, output_lens, options: dict) -> dict:
    from actors.embedded_valkey import EmbeddedValkey
    from clients import Client
    from tqdm import tqdm
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    with tempfile.TemporaryDirectory() as data_dir, EmbeddedValkey(data_dir, password=None) as server:
        conveyor = Path(sys.executable).with_name("conveyor")
        replica = subprocess.Popen([str(conveyor), "serve", "--model", model, "--redis-url", server.url, *flags],
                                   env={**os.environ, "CONVEYOR_LOG_LEVEL": "WARNING"})
        try:
            client = Client(server.url)
            client.submit(prompt_token_ids=prompts[0], max_tokens=4).result(timeout=600)  # ready + warm
            start = time.perf_counter()
            jobs = client.submit_many([{"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True,
                                        "temperature": 0} for p, n in zip(prompts, output_lens)], progress=False)
            tokens = sum(len(job.result(timeout=1800).token_ids) for job in tqdm(jobs, desc="queue"))
            elapsed = time.perf_counter() - start
        finally:
            replica.terminate()
            replica.wait(60)
    assert tokens == sum(output_lens)
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=32)
    args = parser.parse_args()
    from engine.models.loader import load_spec
    prompts, output_lens = make_workload(args.num_requests, load_spec(args.model).hf_config.vocab_size)
    options = dict(max_num_seqs=64, max_num_batched_tokens=512)
    queue = run_queue(args.model, prompts, output_lens, options)
    offline = run_ours(args.model, prompts, output_lens, **options)
    print(f"\nworkload: {args.num_requests} requests, {sum(output_lens)} output tokens, {args.model}")
    print(f"  offline LLM : {offline['tokens_per_s']:7.1f} output tok/s  {offline['seconds']:6.1f} s")
    print(f"  queue+actors: {queue['tokens_per_s']:7.1f} output tok/s  {queue['seconds']:6.1f} s")
    print(f"  queue / offline = {queue['tokens_per_s'] / offline['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
