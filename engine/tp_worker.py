"""A follower rank's process (``python -m conveyor.engine.tp_worker``, beside the engine core's: it stands above
engine/distributed/, whose pieces it runs): joins rank 0's group, builds its shard of the model and its KV
cache (a ModelRunner of its own), then runs each step plan rank 0 sends until told to stop.
It never samples: rank 0 sends the tokens it sampled along with the next plan."""

import pickle
import sys

import torch

from conveyor.engine.distributed.group import TPGroup, join_store, rank_device
from conveyor.engine.distributed.step_message import decode_step
from conveyor.engine.model_runner import ModelRunner, resolve_device
from conveyor.engine.models.loader import load_spec


def run_worker(config, rank: int, port: int, max_model_len: int, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    store = join_store(port, config.tensor_parallel_size)
    store.set(f"joined/{rank}", "1")
    group = TPGroup(store, rank, config.tensor_parallel_size, rank_device(resolve_device(config.device), rank))
    runner = ModelRunner(config, load_spec(config.model), max_model_len, tp=group)
    try:
        while (message := group.receive_step()) is not None:
            runner.follow(*decode_step(message))
    except RuntimeError as exc:  # rank 0 is gone (its socket closed) or a collective timed out
        print(f"conveyor tensor-parallel rank {rank}: stopping: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":  # started by engine/distributed/launcher.py, arguments pickled on stdin
    from conveyor.engine.child_env import ignore_stop_signals

    ignore_stop_signals()  # a rank ends with rank 0, never by a Ctrl-C to the process group
    run_worker(**pickle.loads(sys.stdin.buffer.read()))
