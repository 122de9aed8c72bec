"""``conveyor dead list|requeue``: the dead-letter stream from the command line."""

from __future__ import annotations

import argparse
import datetime

from conveyor.clients.client import Client
from conveyor.clients.connection import command_settings
from conveyor.clients.dead_letters import iter_dead, requeue


def register_dead(subparsers: argparse._SubParsersAction, connection: argparse.ArgumentParser) -> None:
    dead = subparsers.add_parser("dead", help="list or requeue dead-lettered jobs")
    actions = dead.add_subparsers(dest="dead_action", required=True)
    listing = actions.add_parser("list", parents=[connection], help="show parked entries and why")
    listing.add_argument("--count", type=int, default=100, help="show at most this many (0: all); default 100")
    listing.add_argument("--after", default="-", help="start after this dead-letter id (to page on)")
    listing.set_defaults(func=run_dead_list)
    again = actions.add_parser(
        "requeue",
        parents=[connection],
        help="put entries back on their streams (never a finished job's: the letter fails, naming it)",
    )
    again.add_argument("ids", nargs="*", help="dead-letter ids (default: all)")
    again.set_defaults(func=run_dead_requeue)


def run_dead_list(args: argparse.Namespace) -> int:
    """Streams page by page: a long dead-letter stream is never held in memory at once."""
    start = "-" if args.after == "-" else "(" + args.after
    shown, last_id = 0, None
    with Client(namespace=args.namespace, connection=command_settings(args)) as client:
        for letter in iter_dead(client.redis, client.keys, start=start):
            if args.count and shown == args.count:
                print(f"... more: --after {last_id}")
                break
            print(_line(letter))
            shown, last_id = shown + 1, letter.dead_id
    print(f"{shown} dead letter(s) shown")
    return 0


def _line(letter) -> str:
    when = datetime.datetime.fromtimestamp(letter.at).isoformat(timespec="seconds")
    kept = f"payload not kept ({letter.size} bytes)" if letter.truncated else "payload kept"
    return f"{letter.dead_id}  {when}  job={letter.job_id or '?'}  {letter.stream}  {kept}  {letter.reason}"


def run_dead_requeue(args: argparse.Namespace) -> int:
    with Client(namespace=args.namespace, connection=command_settings(args)) as client:
        new_ids, skipped, failed = requeue(client.redis, client.keys, args.ids or None)
    print(f"requeued {len(new_ids)} job(s)")
    if skipped:
        print(
            f"skipped {len(skipped)} whose payload was not kept (unreadable, invalid or conflicting entries: "
            f"they would fail again), e.g. {skipped[0].dead_id}: {skipped[0].reason}"
        )
    for letter, why in failed:
        print(f"could not requeue {letter.dead_id}: {why}")
    return 1 if failed else 0
