"""Which waiting sequences may be admitted now: the batching policy switch.

continuous: anyone, every step (iteration-level batching).
dynamic: request-level batching; collect up to ``max_batch_size`` requests or wait
``batch_window_ms`` from the oldest one, then run that batch until all of it finishes
while newcomers wait.
"""

from conveyor.engine.config import EngineConfig
from conveyor.engine.sequence import Sequence


class ContinuousBatching:
    def admissible(self, ranked_waiting: list[Sequence], now: float) -> list[Sequence]:
        return ranked_waiting

    def on_finish(self, seq: Sequence) -> None:
        pass

    def seconds_until_ready(self, waiting: list[Sequence], now: float) -> float:
        return 0.0


class DynamicBatching:
    def __init__(self, max_batch_size: int, window_s: float):
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.batch: set[str] = set()  # ids of the batch being run; empty between batches

    def admissible(self, ranked_waiting: list[Sequence], now: float) -> list[Sequence]:
        if not self.batch:
            if self.seconds_until_ready(ranked_waiting, now) > 0:
                return []
            self.batch = {s.seq_id for s in ranked_waiting[: self.max_batch_size]}
        return [s for s in ranked_waiting if s.seq_id in self.batch]

    def on_finish(self, seq: Sequence) -> None:
        self.batch.discard(seq.seq_id)

    def seconds_until_ready(self, waiting: list[Sequence], now: float) -> float:
        """0 when a batch can start now; else how long until its window closes."""
        if self.batch or len(waiting) >= self.max_batch_size:
            return 0.0
        if not waiting:
            return float("inf")
        oldest = min(s.arrival_time for s in waiting)
        return max(0.0, oldest + self.window_s - now)


def make_policy(config: EngineConfig):
    if config.batching == "dynamic":
        return DynamicBatching(min(config.max_batch_size, config.max_num_seqs), config.batch_window_ms / 1000)
    return ContinuousBatching()
