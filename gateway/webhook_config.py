"""Where each namespace's webhook events go (docs/webhooks.md): the operator's
`--webhook-url` and `--webhook-secret-file` for every namespace the gateway serves, or a
keys-file grant's `webhook_url` / `webhook_secret_file` for its namespace. Only the operator
names addresses: no producer, job or HTTP request can.

A secret file holds one line `whsec_<base64>` (Standard Webhooks); the key is the decoded
bytes. A malformed file stops the gateway at startup, and no message ever shows the secret.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

SECRET_PREFIX = "whsec_"
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 24, 64  # Standard Webhooks: secrets of 24 to 64 bytes
MAX_SECRET_FILE_BYTES = 4096
MAX_URL_CHARS = 2048
MAX_CONCURRENCY = 256
MAKE_SECRET = "python -c \"import base64,os;print('whsec_'+base64.b64encode(os.urandom(32)).decode())\""


@dataclass(frozen=True)
class WebhookTarget:
    """One namespace's receiver: its URL, the signing key, and how deliveries are paced."""

    url: str
    key: bytes = field(repr=False)
    secret_file: str = ""
    timeout_s: float = 10.0  # one attempt, connect to answer
    retry_for_s: float = 72 * 3600.0  # after this long since the event, it is dead-lettered
    concurrency: int = 8  # attempts in flight at once for this namespace

    @property
    def host(self) -> str:
        """What logs show of the URL (never its path, query or credentials)."""
        return urlsplit(self.url).hostname or "?"


def check_url(url: Any, where: str) -> str:
    """An http(s) URL with a host; ValueError naming `where` and the rule otherwise."""
    rule = f"an http:// or https:// URL with a host, at most {MAX_URL_CHARS} characters"
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise ValueError(f"{where} must be {rule}")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(f"{where} must be {rule} (no spaces or control characters)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port out of range or not a number)
    except ValueError as exc:
        raise ValueError(f"{where} must be {rule}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where} must be {rule}, got scheme {parts.scheme!r} and host {parts.hostname!r}")
    return url


def read_secret(path: str) -> bytes:
    """The signing key of a secret file (`whsec_` + base64 of 24 to 64 bytes)."""
    expected = (
        f"expected one line 'whsec_<base64 of {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} random bytes>' "
        f"(make one with: {MAKE_SECRET})"
    )
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"webhook secret file {path}: cannot read it ({exc.strerror or exc}); {expected}") from None
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"webhook secret file {path}: over {MAX_SECRET_FILE_BYTES} bytes; {expected}")
    text = raw.decode("ascii", "replace").strip()
    if not text.startswith(SECRET_PREFIX):
        raise ValueError(f"webhook secret file {path}: does not start with {SECRET_PREFIX!r}; {expected}")
    try:
        key = base64.b64decode(text[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"webhook secret file {path}: the text after {SECRET_PREFIX!r} is not base64; {expected}")
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise ValueError(f"webhook secret file {path}: the key is {len(key)} bytes; {expected}")
    return key


def check_pacing(retry_for_s: float, timeout_s: float, concurrency: int) -> None:
    """The operator's delivery options (ValueError naming the flag and its range)."""
    if not (math.isfinite(retry_for_s) and retry_for_s > 0):
        raise ValueError(f"--webhook-retry-for must be seconds > 0, got {retry_for_s}")
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= 600):
        raise ValueError(f"--webhook-timeout must be seconds in (0, 600], got {timeout_s}")
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"--webhook-concurrency must be 1..{MAX_CONCURRENCY}, got {concurrency}")


def webhook_targets(settings: Any, grants: dict[str, Any], namespaces: list[str]) -> dict[str, WebhookTarget]:
    """namespace -> its target, for each of `namespaces` that has a webhook URL (the gateway's,
    or the one its grants name). The grants of one namespace that name a URL or secret file
    must name the same; a URL without a secret file anywhere is an error."""
    overrides = _overrides(grants)
    targets, keys = {}, {}
    for namespace in namespaces:
        own = overrides.get(namespace, {})
        url = own.get("webhook_url") or settings.webhook_url
        secret_file = own.get("webhook_secret_file") or settings.webhook_secret_file
        if not url:
            continue
        if not secret_file:
            raise ValueError(
                f"namespace {namespace!r} has a webhook URL but no secret file: give --webhook-secret-file "
                "(env CONVEYOR_GATEWAY_WEBHOOK_SECRET_FILE) or the grant's webhook_secret_file"
            )
        if secret_file not in keys:
            keys[secret_file] = read_secret(secret_file)
        targets[namespace] = WebhookTarget(
            url=check_url(url, f"webhook URL of namespace {namespace!r}"),
            key=keys[secret_file],
            secret_file=secret_file,
            timeout_s=settings.webhook_timeout,
            retry_for_s=settings.webhook_retry_for,
            concurrency=settings.webhook_concurrency,
        )
    return targets


def _overrides(grants: dict[str, Any]) -> dict[str, dict[str, str]]:
    """namespace -> the webhook fields its grants name (those naming one must agree)."""
    found: dict[str, dict[str, str]] = {}
    for grant in grants.values():
        own = found.setdefault(grant.namespace, {})
        for name in ("webhook_url", "webhook_secret_file"):
            value = getattr(grant, name, None)
            if value is None:
                continue
            if own.get(name, value) != value:
                raise ValueError(
                    f"keys file: the keys of namespace {grant.namespace!r} name different {name}s: "
                    f"every key of one namespace must name the same {name} (or none)"
                )
            own[name] = value
    return found
