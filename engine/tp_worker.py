"""A follower rank's process (``python -m conveyor.engine.tp_worker``, beside the engine core's: it stands above
engine/distributed/, whose pieces it runs): joins rank 0's group, builds its share of the model (its tensor
shard of its pipeline stage's layers) and their KV cache (a ModelRunner of its own), then runs each step plan
until told to stop. Stage 0's ranks get the plans from rank 0's broadcast; a later stage's from the same
tensor rank of the stage before, with that stage's activations. It never samples: rank 0 sends the tokens
it sampled along with a later plan. ``conveyor rank`` starts one on another host (``join``)."""

import json
import pickle
import sys

import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.distributed.group import RankGroup, join_store, rank_device
from conveyor.engine.distributed.step_message import decode_step
from conveyor.engine.model_runner import ModelRunner, resolve_device
from conveyor.engine.models.loader import load_spec


def run_worker(config, rank: int, address: str, port: int, max_model_len: int, num_threads: int, store=None) -> None:
    torch.set_num_threads(num_threads)
    store = store or join_store(address, port, config.world_size)
    store.set(f"joined/{rank}", "1")
    local_rank = rank % (config.world_size // config.nnodes)
    device = rank_device(resolve_device(config.device), local_rank)
    group = RankGroup(store, rank, config.tensor_parallel_size, config.pipeline_parallel_size, device)
    runner = ModelRunner(config, load_spec(config.model), max_model_len, tp=group)
    try:
        if runner.link is None:
            while (message := group.receive_step()) is not None:
                runner.follow(*decode_step(message))
        else:
            _follow_stages(runner, group)
    except RuntimeError as exc:  # rank 0 is gone (its socket closed) or a collective timed out
        print(f"conveyor parallel rank {rank}: stopping: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


def _follow_stages(runner: ModelRunner, group: RankGroup) -> None:
    """A pipeline rank: each plan (and its activations) from where it comes, this stage's
    layers, on to the next stage (or the final hidden states back to rank 0)."""
    while True:
        if group.stage == 0:
            message, activations = group.receive_step(), None
        else:
            message, activations = runner.link.receive()
        if message is None:
            runner.link.send_on(None)
            return
        output = runner.follow(*decode_step(message), activations)
        if runner.link.next is not None:
            runner.link.send_on(message, output)
        elif output is not None:
            runner.link.send_final(output)


def join(address: str, port: int, rank: int, num_threads: int | None = None) -> None:
    """Rank ``rank`` from another host: the engine's options come from rank 0's rendezvous
    (as JSON); the model must be at the same path here."""
    store = join_store(address, port, None)
    options = json.loads(store.get("config"))
    config = EngineConfig(**options["config"])
    first = config.world_size // config.nnodes  # rank 0's host starts the ranks below this one
    if not first <= rank < config.world_size:
        raise SystemExit(
            f"conveyor rank: --rank must be in [{first}, {config.world_size - 1}] for this group "
            f"(rank 0's host runs ranks 0..{first - 1}), got {rank}"
        )
    run_worker(config, rank, address, port, options["max_model_len"], num_threads or torch.get_num_threads(), store)


if __name__ == "__main__":  # started by engine/distributed/launcher.py, arguments pickled on stdin
    from conveyor.engine.child_env import ignore_stop_signals

    ignore_stop_signals()  # a rank ends with rank 0, never by a Ctrl-C to the process group
    run_worker(**pickle.loads(sys.stdin.buffer.read()))
