"""I/O-free status of a namespace: default and per-model request streams, their consumer
group and consumers, published models, dead letters. Both clients queue the same reads on
one pipeline (run with raise_on_error=False: a missing stream or group reads as empty)."""

from __future__ import annotations

from typing import Any, Iterable

from conveyor.clients.keys import GROUP, PRIORITY_CLASSES, Keys


def model_names(keys: Keys, published: Iterable[bytes], stream_keys: Iterable[bytes]) -> list[str]:
    """Published models plus every model that has a request stream (served or not)."""
    names = {_text(name) for name in published}
    for key in map(_text, stream_keys):
        names.update(filter(None, (keys.model_of_stream(key, c) for c in PRIORITY_CLASSES)))
    return sorted(names)


def status_streams(keys: Keys, models: list[str]) -> list[str]:
    return [*keys.all_requests, *(s for model in models for s in keys.all_model_requests(model))]


def queue_status_commands(keys: Keys, models: list[str]) -> list[tuple]:
    """The reads, in order, as (redis method, *args)."""
    commands: list[tuple] = []
    for stream in status_streams(keys, models):
        commands += [("xlen", stream), ("xinfo_groups", stream), ("xinfo_consumers", stream, GROUP)]
    commands += [("hget", keys.model_info(model), "max_model_len") for model in models]
    return [*commands, ("xlen", keys.dead)]


def queue_status_from(keys: Keys, models: list[str], replies: list[Any]) -> dict[str, Any]:
    """Plain-data status from the replies to queue_status_commands, in order."""
    answers = iter(replies)
    streams = {s: _stream_status(s, next(answers), next(answers), next(answers)) for s in status_streams(keys, models)}
    max_lens = {model: next(answers) for model in models}
    dead_len = next(answers)
    return {
        "namespace": keys.ns,
        "requests": {
            c: _combined([streams[keys.requests(c, p)] for p in range(keys.partitions)]) for c in PRIORITY_CLASSES
        },
        "models": {m: _model_status(keys, m, streams, max_lens[m]) for m in models},
        "dead_letter": {"stream": keys.dead, "length": _int(dead_len)},
    }


def _model_status(keys: Keys, model: str, streams: dict[str, dict], max_model_len: Any) -> dict[str, Any]:
    requests = {
        c: _combined([streams[keys.model_requests(model, c, p)] for p in range(keys.partitions)])
        for c in PRIORITY_CLASSES
    }
    queued = sum(info["length"] for info in requests.values())
    served = any(info["consumers"] for info in requests.values())
    published = isinstance(max_model_len, bytes)
    return {
        "published": published,
        "max_model_len": int(max_model_len) if published else None,
        "requests": requests,
        "queued": queued,
        "unserved": queued > 0 and not (published and served),
    }


def _combined(partitions: list[dict[str, Any]]) -> dict[str, Any]:
    """One class's status over its partitions (one partition: that stream's status itself)."""
    if len(partitions) == 1:
        return partitions[0]
    consumers: dict[str, dict] = {}
    for info in partitions:
        for consumer in info["consumers"]:
            seen = consumers.setdefault(consumer["name"], {**consumer, "pending": 0})
            seen["pending"] += consumer["pending"]
            seen["idle_s"] = min(seen["idle_s"], consumer["idle_s"])
    lags = [info["lag"] for info in partitions]
    return {
        "stream": partitions[0]["stream"].replace("{p0}", "{p*}", 1),  # every partition's, summed
        "streams": [info["stream"] for info in partitions],
        "length": sum(info["length"] for info in partitions),
        "group": all(info["group"] for info in partitions),
        "pending": sum(info["pending"] for info in partitions),
        "lag": None if None in lags else sum(lags),
        "consumers": list(consumers.values()),
        "partitions": partitions,
    }


def _stream_status(stream: str, length: Any, groups: Any, consumers: Any) -> dict[str, Any]:
    groups = groups if isinstance(groups, list) else []
    group = next((g for g in groups if _text(g.get("name")) == GROUP), None)
    return {
        "stream": stream,
        "length": _int(length),
        "group": group is not None,
        "pending": int(group.get("pending", 0)) if group else 0,
        "lag": group.get("lag") if group else None,
        "consumers": [_consumer(c) for c in consumers] if isinstance(consumers, list) else [],
    }


def _consumer(info: dict) -> dict[str, Any]:
    inactive = info.get("inactive")
    return {
        "name": _text(info.get("name")),
        "pending": int(info.get("pending", 0)),
        "idle_s": int(info.get("idle", 0)) / 1000,
        "inactive_s": None if inactive in (None, -1) else int(inactive) / 1000,
    }


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
