"""``conveyor dead list|requeue``: the dead-letter stream from the command line."""
from __future__ import annotations

import argparse
import datetime

from clients.client import Client
from clients.dead_letters import list_dead, requeue


def register_dead(subparsers: argparse._SubParsersAction, connection: argparse.ArgumentParser) -> None:
    dead = subparsers.add_parser("dead", help="list or requeue dead-lettered jobs")
    actions = dead.add_subparsers(dest="dead_action", required=True)
    listing = actions.add_parser("list", parents=[connection], help="show parked entries and why")
    listing.add_argument("--count", type=int, default=100)
    listing.set_defaults(func=run_dead_list)
    again = actions.add_parser("requeue", parents=[connection], help="put entries back on their streams")
    again.add_argument("ids", nargs="*", help="dead-letter ids (default: all)")
    again.set_defaults(func=run_dead_requeue)


def run_dead_list(args: argparse.Namespace) -> int:
    with Client(args.redis_url, args.namespace) as client:
        letters = list_dead(client.redis, client.keys, args.count)
    for letter in letters:
        when = datetime.datetime.fromtimestamp(letter.at).isoformat(timespec="seconds")
        print(f"{letter.dead_id}  {when}  job={letter.job_id or '?'}  {letter.stream}  {letter.reason}")
    print(f"{len(letters)} dead letter(s)")
    return 0


def run_dead_requeue(args: argparse.Namespace) -> int:
    with Client(args.redis_url, args.namespace) as client:
        new_ids = requeue(client.redis, client.keys, args.ids or None)
    print(f"requeued {len(new_ids)} job(s)")
    return 0
