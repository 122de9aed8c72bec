"""Usage read back across midnight UTC: a job that finishes after it is billed on the next
day, so tests read from the day they started to now and sum each model's rows (a suite run
that crossed midnight failed when it read one day only)."""

import dataclasses
import datetime

from conveyor.clients.usage import read_usage

COUNTERS = ("jobs", "prompt_tokens", "completion_tokens", "cached_tokens")


def utc_today() -> datetime.date:
    return datetime.datetime.now(datetime.timezone.utc).date()


def usage_since(redis, keys, first_day: datetime.date):
    """(one UsageRow per model, summed over first_day..today, named by its last day; skipped)."""
    rows, skipped = read_usage(redis, keys, first_day, utc_today())
    summed = {}
    for row in rows:
        held = summed.get(row.model)
        summed[row.model] = (
            row
            if held is None
            else dataclasses.replace(row, **{name: getattr(held, name) + getattr(row, name) for name in COUNTERS})
        )
    return list(summed.values()), skipped
