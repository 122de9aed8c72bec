"""Token-weighted fair share between tenants (issue 41; the Virtual Token Counter of Sheng et
al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant (a replica's namespace; None: one tenant for every request without one) has a
counter of the tokens it was served, prompt and output alike, each divided by its share. The
scheduler admits waiting sequences tenant by tenant, the backlogged tenant with the smallest
counter first (within a tenant, its own rank: priority class, priority, arrival). A tenant
that had nothing waiting does not bank credit: when it has work waiting again its counter is
lifted to the smallest counter of the tenants with work waiting. (A preempted sequence is
charged again for its recomputed prompt; draft tokens of speculative decoding are not
charged.)

Bound (measured by tests/test_fair_share.py, as in the paper): while two tenants are both
backlogged, their counters differ by at most one step's tokens (``max_num_batched_tokens``)
plus one request's tokens (its prompt and ``max_tokens``), each over the smaller share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.engine.sequence import Sequence

MAX_SHARE = 1_000_000.0


def check_shares(shares: dict | str | None) -> dict[str, float]:
    """``{tenant: share}`` (or its flag form ``"a=3,b=1"``) validated: ValueError naming the
    tenant and the limit."""
    if isinstance(shares, str):
        shares = dict(_share_of_flag(item) for item in shares.split(",") if item.strip())
    checked = {}
    for tenant, share in (shares or {}).items():
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant_shares: tenant names are non-empty strings, got {tenant!r}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= MAX_SHARE:
            raise ValueError(f"tenant_shares[{tenant!r}]: a number in (0, {MAX_SHARE:g}], got {share!r}")
        checked[tenant] = float(share)
    return checked


def _share_of_flag(item: str) -> tuple[str, float]:
    tenant, sep, share = item.strip().partition("=")
    try:
        return tenant, float(share) if sep else float("nan")
    except ValueError:
        raise ValueError(f"tenant_shares: {item.strip()!r} is not NAME=SHARE") from None


class FairShare:
    def __init__(self, shares: dict[str, float] | None = None):
        self.shares = check_shares(shares or {})
        self.counters: dict[str | None, float] = {}  # tenant -> served tokens / share
        self.served: Counter = Counter()  # tenant -> tokens served (unweighted, for metrics and tests)
        self.active: Counter = Counter()  # tenant -> its unfinished sequences
        self.waiting: Counter = Counter()  # tenant -> its sequences waiting for admission (backlogged)

    def share_of(self, tenant: str | None) -> float:
        return self.shares.get(tenant, 1.0) if tenant is not None else 1.0

    def arrived(self, seq: Sequence) -> None:
        """A sequence of ``seq.tenant`` joins the waiting queue (new, or preempted back)."""
        self.active[seq.tenant] += 1
        self.queued(seq)

    def queued(self, seq: Sequence) -> None:
        """``seq`` is waiting: a tenant that had nothing waiting starts level with the lowest
        counter among those that do (no banked credit, however long it ran or idled)."""
        tenant = seq.tenant
        if not self.waiting[tenant]:
            busy = [self.counters.get(t, 0.0) for t, n in self.waiting.items() if n and t != tenant]
            if busy:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(busy))
        self.waiting[tenant] += 1

    def admitted(self, seq: Sequence) -> None:
        self._drop(self.waiting, seq.tenant)

    def finished(self, seq: Sequence, was_waiting: bool) -> None:
        self._drop(self.active, seq.tenant)
        if was_waiting:
            self._drop(self.waiting, seq.tenant)

    @staticmethod
    def _drop(counts: Counter, tenant: str | None) -> None:
        counts[tenant] -= 1
        if counts[tenant] <= 0:
            del counts[tenant]

    def charge(self, seq: Sequence, tokens: int) -> None:
        """``tokens`` computed for ``seq`` this step (prompt chunk or decode)."""
        self.served[seq.tenant] += tokens
        self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + tokens / self.share_of(seq.tenant)

    def admission_order(self, ranked: Iterable[Sequence]) -> list[Sequence]:
        """``ranked`` (each tenant's sequences in its own order) interleaved by projected
        counters: the next one always comes from the tenant whose counter, with the prompts
        already placed before it, is lowest."""
        queues: dict[str | None, list[Sequence]] = {}
        for seq in ranked:
            queues.setdefault(seq.tenant, []).append(seq)
        if len(queues) < 2:
            return [seq for queue in queues.values() for seq in queue]
        projected = {tenant: self.counters.get(tenant, 0.0) for tenant in queues}
        heads = {tenant: 0 for tenant in queues}
        order = []
        while heads:
            tenant = min(heads, key=lambda t: (projected[t], str(t)))
            seq = queues[tenant][heads[tenant]]
            order.append(seq)
            projected[tenant] += max(1, seq.num_unscheduled_tokens) / self.share_of(tenant)
            heads[tenant] += 1
            if heads[tenant] == len(queues[tenant]):
                del heads[tenant]
        return order
