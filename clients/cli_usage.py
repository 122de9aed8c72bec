"""``conveyor usage``: the namespace's billable usage per UTC day and model (clients/usage.py)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from conveyor.clients.client import Client
from conveyor.clients.connection import command_settings
from conveyor.clients.usage import COUNTERS, MAX_USAGE_DAYS, read_usage

EXIT_OK, EXIT_USAGE = 0, 2


def register_usage(subparsers: argparse._SubParsersAction, connection: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "usage", parents=[connection], help="tokens and jobs per day and model, counted once per finished job"
    )
    parser.add_argument("--start", type=_day, default=None, help="first UTC day, YYYY-MM-DD (default: 30 days ago)")
    parser.add_argument("--end", type=_day, default=None, help="last UTC day, YYYY-MM-DD (default: today)")
    parser.add_argument("--json", action="store_true", help="one JSON object: rows, totals, skipped keys")
    parser.set_defaults(func=run_usage)


def run_usage(args: argparse.Namespace) -> int:
    end = args.end or datetime.datetime.now(datetime.timezone.utc).date()
    start = args.start or end - datetime.timedelta(days=29)
    if (end - start).days + 1 > MAX_USAGE_DAYS or end < start:
        print(f"error: --start..--end must be 1 to {MAX_USAGE_DAYS} days, got {start}..{end}", file=sys.stderr)
        return EXIT_USAGE
    with Client(namespace=args.namespace, connection=command_settings(args)) as client:
        rows, skipped = read_usage(client.redis, client.keys, start, end)
        namespace = client.keys.ns
    totals = {name: sum(getattr(row, name) for row in rows) for name in COUNTERS}
    if args.json:
        report = {"namespace": namespace, "start": start.isoformat(), "end": end.isoformat()}
        print(json.dumps({**report, "rows": [r.as_dict() for r in rows], "totals": totals, "skipped": skipped}))
    else:
        print(_table(namespace, start, end, rows, totals))
    for key in skipped:
        print(f"warning: skipped {key}: not a usage hash this replica wrote", file=sys.stderr)
    return EXIT_OK


def _table(namespace: str, start, end, rows, totals: dict) -> str:
    lines = [f"namespace {namespace}, {start} to {end} (UTC)", f"{'day':<10}  {'model':<24}  " + "  ".join(COUNTERS)]
    for row in rows:
        counts = "  ".join(f"{getattr(row, name):>{len(name)}}" for name in COUNTERS)
        lines.append(f"{row.day:<10}  {row.model[:24]:<24}  {counts}")
    lines.append(f"{'total':<10}  {'':<24}  " + "  ".join(f"{totals[name]:>{len(name)}}" for name in COUNTERS))
    return "\n".join(lines)


def _day(text: str) -> datetime.date:
    try:
        return datetime.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a YYYY-MM-DD day: {text!r}") from None
