"""Conveyor light client: wire protocol, sync and async clients. Needs only redis,
msgpack, pydantic and tqdm (never torch, transformers, engine/ or actors/).

Names are imported on first use (PEP 562), so ``clients.limits`` — plain constants shared
with the engine's own validation — can be imported without loading redis or pydantic."""

import importlib

_EXPORTS = {
    "AsyncClient": "clients.async_client", "AsyncJob": "clients.async_client",
    "Client": "clients.client", "Job": "clients.client",
    "ConveyorError": "clients.errors", "InvalidJob": "clients.errors", "JobConflict": "clients.errors",
    "JobCancelled": "clients.errors", "JobFailed": "clients.errors", "ProtocolError": "clients.errors",
    "QueueFull": "clients.errors", "Timeout": "clients.errors",
    "JobResult": "clients.event_reader", "JobStatus": "clients.event_reader",
    "CancelledEvent": "clients.events", "DoneEvent": "clients.events", "ErrorEvent": "clients.events",
    "TokenEvent": "clients.events",
    "GROUP": "clients.keys", "PRIORITY_CLASSES": "clients.keys", "Keys": "clients.keys",
    "SCHEMA_VERSION": "clients.protocol", "JobRequest": "clients.protocol", "decode_event": "clients.protocol",
    "decode_job": "clients.protocol", "encode_event": "clients.protocol", "encode_job": "clients.protocol",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'clients' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
