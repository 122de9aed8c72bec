"""Kill -9 of a replica part-way through a batch of long jobs, with and without resuming.

    python benchmarks/resume_after_kill.py [--model smollm2] [--jobs 8] [--max-tokens 384]
                                           [--at 25,50,75] [--lease-s 2] [--plot docs/resume.png]

Two ``conveyor serve`` replicas (engine on a thread, one compute thread each, lease
``--lease-s``) share one embedded Valkey. For each kill point p and each mode (``resume``: the default ``--max-resumes 3``;
``rerun``: ``--max-resumes 0``), a batch of greedy jobs is submitted, the replica holding
the most of them is SIGKILLed once p% of the batch's tokens are published, and the batch is
waited for on the survivor. Printed per run: decode tokens spent (every token event of
every attempt: what the engines computed), wall time from submit to the last result, and
the ratio rerun / resume. A fresh pair of replicas serves each run.
"""

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, embedded_valkey, spawned_replica, write_json  # noqa: E402

MODES = {"resume": ["--max-resumes", "3"], "rerun": ["--max-resumes", "0"]}
# one compute thread each: two replicas' thread pools on one small box would oversubscribe
# its cores whenever the batch happens to split between them (a 5x slowdown measured)
REPLICA_ENV = {"OMP_NUM_THREADS": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}


def run_once(args, url: str, mode: str, percent: int, run: int) -> dict:
    from conveyor.clients import Client
    from conveyor.clients.events import decode_event
    from conveyor.clients.keys import GROUP

    namespace = f"bench-resume-{mode}-{percent}-{run}"
    flags = ["--namespace", namespace, "--lease-s", str(args.lease_s), "--engine-process", "false", *MODES[mode]]
    names = [f"{namespace}-a", f"{namespace}-b"]
    replicas = [
        spawned_replica(args.model, url, flags, env={"CONVEYOR_CONSUMER": name, **REPLICA_ENV}) for name in names
    ]
    processes = [replica.__enter__() for replica in replicas]
    try:
        client = Client(url, namespace=namespace)
        warm = client.submit(prompt_token_ids=[1, 2, 3], max_tokens=2)
        warm.result(timeout=600)
        wait_for_consumers(client, names)
        total = args.jobs * args.max_tokens
        started = time.perf_counter()
        jobs = [
            client.submit(
                prompt_token_ids=[10 + i, 20 + i, 30 + i, 40],
                max_tokens=args.max_tokens,
                temperature=0,
                ignore_eos=True,
            )
            for i in range(args.jobs)
        ]
        while published_tokens(client, jobs, decode_event) < total * percent / 100:
            time.sleep(0.05)
        owners = {}
        for stream in client.keys.all_requests:
            for item in client.redis.xpending_range(stream, GROUP, min="-", max="+", count=10_000):
                owner = item["consumer"].decode()
                owners[owner] = owners.get(owner, 0) + 1
        victim = max(names, key=lambda name: owners.get(name, 0))
        os.kill(processes[names.index(victim)].pid, signal.SIGKILL)
        results = [job.result(timeout=3600) for job in jobs]
        wall_s = time.perf_counter() - started
        decoded = published_tokens(client, jobs, decode_event)
        assert all(len(r.token_ids) == args.max_tokens for r in results)
        resumed = sum(r.resumed_tokens for r in results)
        return {"mode": mode, "at": percent, "decoded": decoded, "wall_s": wall_s, "resumed": resumed, "useful": total}
    finally:
        for replica in replicas:
            replica.__exit__(None, None, None)


def wait_for_consumers(client, names: list[str], timeout: float = 600) -> None:
    """Both replicas reading (the warm-up job proved only one)."""
    from conveyor.clients.keys import GROUP

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = set()
        for stream in client.keys.all_requests:
            try:
                seen |= {c["name"].decode() for c in client.redis.xinfo_consumers(stream, GROUP)}
            except Exception:  # noqa: BLE001 - the group is made by the first replica to read
                pass
        if set(names) <= seen:
            return
        time.sleep(0.2)
    raise TimeoutError("the replicas did not start reading")


def published_tokens(client, jobs, decode_event) -> int:
    """Token ids in every token event of every attempt of `jobs` (what the engines decoded)."""
    pipe = client.redis.pipeline(transaction=False)
    for job in jobs:
        pipe.xrange(client.keys.out(job.job_id))
    count = 0
    for entries in pipe.execute():
        for entry_id, fields in entries:
            event = decode_event(fields, entry_id.decode())
            count += len(getattr(event, "token_ids", ())) if event.type == "token" else 0
    return count


def report(rows: list[dict], args) -> dict:
    print(
        f"\n{describe_cpu()}\n{args.jobs} greedy jobs x {args.max_tokens} tokens, {args.model}, lease {args.lease_s} s"
    )
    print(f"{'kill at':>8} {'mode':>7} {'decoded':>8} {'x useful':>9} {'wall s':>7} {'resumed':>8}")
    summary = {}
    for percent in args.at:
        for mode in MODES:
            mine = [r for r in rows if r["at"] == percent and r["mode"] == mode]
            decoded = statistics.median(r["decoded"] for r in mine)
            wall = statistics.median(r["wall_s"] for r in mine)
            resumed = statistics.median(r["resumed"] for r in mine)
            summary[f"{mode}@{percent}"] = {"decoded": decoded, "wall_s": wall, "resumed": resumed}
            print(
                f"{percent:>7}% {mode:>7} {decoded:>8.0f} {decoded / mine[0]['useful']:>9.2f} {wall:>7.1f} {resumed:>8.0f}"
            )
        ratio = summary[f"rerun@{percent}"]["wall_s"] / summary[f"resume@{percent}"]["wall_s"]
        print(f"{'':>8} rerun / resume wall time: {ratio:.2f}")
    return summary


def plot(summary: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.38
    for offset, mode in ((-width / 2, "resume"), (width / 2, "rerun")):
        xs = [i + offset for i in range(len(args.at))]
        axes[0].bar(xs, [summary[f"{mode}@{p}"]["decoded"] for p in args.at], width, label=mode)
        axes[1].bar(xs, [summary[f"{mode}@{p}"]["wall_s"] for p in args.at], width, label=mode)
    for axis, title in zip(axes, ("tokens decoded", "wall time to finish the batch (s)")):
        axis.set_xticks(range(len(args.at)), [f"kill at {p}%" for p in args.at])
        axis.set_title(title)
        axis.legend()
    fig.suptitle(f"kill -9 mid-batch: {args.jobs} x {args.max_tokens} tokens, {args.model}")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--at", default="25,50,75", help="kill points, percent of the batch's tokens")
    parser.add_argument("--lease-s", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=1, help="runs per kill point and mode (median)")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.at = [int(p) for p in args.at.split(",")]
    rows = []
    with embedded_valkey() as url:
        for run in range(args.runs):
            for percent in args.at:
                for mode in MODES:
                    row = run_once(args, url, mode, percent, run)
                    rows.append(row)
                    print(
                        f"run {run + 1} kill at {percent}% {mode:>6}: {row['decoded']} tokens decoded, "
                        f"{row['wall_s']:.1f} s, {row['resumed']} resumed",
                        flush=True,
                    )
    summary = report(rows, args)
    if args.plot:
        plot(summary, args)
    write_json(args.json, {"cpu": describe_cpu(), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
