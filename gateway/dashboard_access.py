"""Who may look at which namespace on the dashboard, and act there.

- No API keys configured: the gateway's namespace, open as the rest of the gateway (which
  listens on loopback unless told otherwise), actions allowed.
- A key flagged `admin: true` in the keys file: every namespace of the configured keys
  (`?ns=`, default its own), actions allowed.
- Any other key: its own namespace only, read-only (requeue is an operator's act).

Actions (POST) also need the header `X-Conveyor-Dashboard: 1`: a page of another site
cannot send it without a CORS preflight, which the gateway never grants.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from conveyor.apps.openai_api.errors import OpenAIError
from conveyor.gateway.tenants import bearer_token

ACTION_HEADER = "x-conveyor-dashboard"


@dataclass(frozen=True)
class Viewer:
    namespace: str
    may_act: bool
    namespaces: tuple[str, ...]  # what this viewer may switch to


def viewer_of(request: Request) -> Viewer:
    """FastAPI dependency: the viewer of a dashboard API request (401/403 otherwise)."""
    state = request.app.state
    asked = request.query_params.get("ns")
    if not state.keyring.enabled:
        namespace = state.settings.namespace
        return Viewer(_allowed(asked, namespace, (namespace,)), True, (namespace,))
    key = bearer_token(request.headers.get("authorization"))
    grant = state.keyring.grant_for(key) if key else None
    if grant is None:
        raise OpenAIError(
            401, "the dashboard needs an API key (an admin key for every namespace)", code="invalid_api_key"
        )
    if grant.admin:
        namespaces = tuple(state.keyring.namespaces())
        return Viewer(_allowed(asked, grant.namespace, namespaces), True, namespaces)
    return Viewer(_allowed(asked, grant.namespace, (grant.namespace,)), False, (grant.namespace,))


def actor_of(request: Request) -> Viewer:
    """FastAPI dependency of the dashboard's actions: a viewer who may act, asking on purpose."""
    viewer = viewer_of(request)
    if not viewer.may_act:
        raise OpenAIError(403, "this key may look but not act: use an admin key", code="permission_denied")
    if request.headers.get(ACTION_HEADER) != "1":
        raise OpenAIError(403, f"dashboard actions need the header {ACTION_HEADER}: 1", code="permission_denied")
    return viewer


def _allowed(asked: str | None, default: str, namespaces: tuple[str, ...]) -> str:
    if not asked:
        return default
    if asked not in namespaces:
        raise OpenAIError(403, "this key may not see that namespace", code="permission_denied")
    return asked
