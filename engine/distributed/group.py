"""The ranks' communication. ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks:
global rank g is tensor rank g % N of pipeline stage g // N. Each stage has one gloo (or NCCL)
process group for its forward's all-reduces, with a timeout, and one for step plans, which
may wait as long as the replica is idle (only stage 0's carries plans: rank 0 broadcasts
them); with more than one stage, one group of every rank carries the stages' hand-offs
(point to point: a plan and its activations from each rank to the same tensor rank of the
next stage, the last stage's hidden states back to rank 0). Built on a TCPStore that rank 0
hosts, not on torch.distributed's global default group, so several engines (and tests) can
live in one process."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_COMPUTE_TIMEOUT_S = 60.0
STORE_TIMEOUT_S = 300  # the ranks building their groups: each has imported torch and read the config
STORE_RUNTIME_TIMEOUT_S = 2
IDLE_TIMEOUT = timedelta(days=3650)  # a follower waits for the next plan as long as the driver is idle
STOP = -1  # a plan length that means: no more steps


class RankGroup:
    """One rank's end of the groups: ``all_reduce`` (the forward, within its stage),
    ``send_step`` (rank 0) and ``receive_step`` (stage 0's other ranks), ``pipe`` (the stages'
    hand-offs, engine/distributed/pipeline.py); counts the bytes each moves. ``rank`` and
    ``size`` are the tensor rank and size within the stage (what a shard needs)."""

    def __init__(self, store: dist.Store, global_rank: int, tp_size: int, pp_size: int, device: torch.device):
        self.global_rank, self.world_size = global_rank, tp_size * pp_size
        self.rank, self.size = global_rank % tp_size, tp_size
        self.stage, self.num_stages = global_rank // tp_size, pp_size
        self.device = device
        self.store = store  # rank 0's hosts the rendezvous: kept alive as long as the group
        self.compute = _process_group(
            dist.PrefixStore(f"compute/{self.stage}", store),
            self.rank,
            tp_size,
            device,
            timedelta(seconds=compute_timeout_s()),
        )
        self.plans = _process_group(
            dist.PrefixStore(f"plans/{self.stage}", store), self.rank, tp_size, torch.device("cpu"), IDLE_TIMEOUT
        )
        # every rank (idle stages wait on it for the next plan): the stages' hand-offs. gloo
        # through host memory even on CUDA: with two steps in flight, rank 0 sends step k+1
        # before it takes step k's result while the last stage sends that result before it
        # takes step k+1, which NCCL's one ordered stream per pair of ranks could deadlock
        self.pipe = (
            _process_group(
                dist.PrefixStore("pipe", store), global_rank, self.world_size, torch.device("cpu"), IDLE_TIMEOUT
            )
            if pp_size > 1
            else None
        )
        # set up: a failed collective's error path also waits on the store (measured: a 3 s
        # all-reduce timeout raised after ~300 s under the setup timeout)
        store.set_timeout(timedelta(seconds=STORE_RUNTIME_TIMEOUT_S))
        self.bytes_all_reduced = 0  # this rank's tensors summed over the group (payload, not wire bytes)
        self.num_all_reduces = 0
        self.seconds_all_reducing = 0.0  # wall time rank 0 spent in them (waiting for the others too)
        self.plan_bytes = 0  # step messages, length headers included
        self.num_plans = 0
        self.bytes_handed_on = 0  # activations sent to the next stage (or back to rank 0)
        self.seconds_waiting_on_stages = 0.0  # rank 0: waiting for the last stage's hidden states

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place (every rank gets the same sum)."""
        started = time.perf_counter()
        self.compute.allreduce([tensor]).wait()
        self.seconds_all_reducing += time.perf_counter() - started
        self.bytes_all_reduced += tensor.numel() * tensor.element_size()
        self.num_all_reduces += 1
        return tensor

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (on an idle-timeout group: ranks may arrive far apart)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        if self.pipe is not None:  # every rank of every stage
            self.pipe.allreduce([tensor], opts).wait()
        else:
            self.plans.allreduce([tensor], opts).wait()
        return int(tensor.item())

    def send_step(self, message: bytes | None) -> None:
        """Rank 0: the next step's message to every rank (None: stop)."""
        length = STOP if message is None else len(message)
        self._broadcast(torch.tensor([length], dtype=torch.int64))
        if message is not None:
            self._broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8))
        self.plan_bytes += 8 + max(length, 0)
        self.num_plans += 1

    def receive_step(self) -> bytes | None:
        """The other ranks: the next step's message, or None when rank 0 stops."""
        length = torch.empty(1, dtype=torch.int64)
        self._broadcast(length)
        if int(length.item()) == STOP:
            return None
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(payload)
        return payload.numpy().tobytes()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.plans.broadcast([tensor], opts).wait()

    def stats(self) -> dict:
        return {
            "tp_bytes_all_reduced": self.bytes_all_reduced,
            "tp_num_all_reduces": self.num_all_reduces,
            "tp_all_reduce_s": self.seconds_all_reducing,
            "tp_plan_bytes": self.plan_bytes,
            "tp_num_plans": self.num_plans,
            **(
                {"pp_bytes_handed_on": self.bytes_handed_on, "pp_wait_s": self.seconds_waiting_on_stages}
                if self.pipe is not None
                else {}
            ),
        }


def compute_timeout_s() -> float:
    """A collective of the forward waiting longer than this means a rank hangs (one that
    died fails it at once: its socket closes)."""
    return float(os.environ.get("CONVEYOR_TP_TIMEOUT_S", DEFAULT_COMPUTE_TIMEOUT_S))


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """One CUDA device per rank of a host (cuda:local_rank); the CPU is shared."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def host_store(address: str, port: int, size: int) -> dist.TCPStore:
    """Rank 0's rendezvous at ``address``:``port`` (0: a free port, ``.port``): host it before
    the other ranks start, then build the group (which waits for all of them)."""
    return _store(address, port, size, is_host=True)


def join_store(address: str, port: int, size: int) -> dist.TCPStore:
    return _store(address, port, size, is_host=False)


def _store(address: str, port: int, size: int, is_host: bool) -> dist.TCPStore:
    return dist.TCPStore(
        address, port, size, is_host, timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False
    )


def _process_group(store, rank: int, size: int, device: torch.device, timeout: timedelta):
    if device.type == "cuda":  # untested here: no GPU on the development machine
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
