"""The OpenAI-compatible HTTP gateway: a stateless ASGI app that turns each request into a
queue job and streams the job's events back. A client of the queue: it imports only
`clients` and the OpenAI shapes of `apps` (never torch, engine/ or actors/), so any number of gateways
can run anywhere (the `gateway` extra)."""
