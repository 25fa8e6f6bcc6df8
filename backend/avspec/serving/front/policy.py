"""What the front lets through, shared by both relays: admin authorisation, API keys, Host
names, refusal texts, reserved names, the caller's identity and the extra readiness check.

Identity (`avspec-client`, the key of per-client fairness): with API keys configured
(FrontConfig.access), `key:NAME` of the key the call carries, so clients behind one NAT or
proxy each have their own share; without keys, over HTTP the caller's IP alone,
since an HTTP client program spreads its requests over a pool of connections (and opens new
ones as it likes), each with a port of its own; over gRPC the peer `ip:port`, since one channel
(one connection) is one client program. Clients behind one
NAT or proxy therefore share an identity over HTTP, and so share their fair part.
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from avspec.serving.exposure import ADMIN_KEY_HEADER
from avspec.serving.front.config import FrontConfig

# Any header, metadata key or request parameter containing this is the front's to set: Triton's
# header-forward pattern is a regex search, so even `x-avspec-client` (or, over gRPC,
# `triton-grpc-protocol-avspec-client`) would reach the model.
RESERVED_MARK = "avspec"

ADMIN_HINT = (
    f"operators open the admin API by starting the front with an admin key and sending it in "
    f"header/metadata '{ADMIN_KEY_HEADER}'"
)


def admin_authorized(config: FrontConfig, values: list[str]) -> bool:
    """One admin-key value that equals the configured key (constant-time compare)."""
    if config.admin_key is None or len(values) != 1:
        return False
    return hmac.compare_digest(values[0].encode("latin-1"), config.admin_key.encode("latin-1"))


def refusal(config: FrontConfig, what: str, values: list[str]) -> str:
    """Why `what` is refused to a caller who sent the admin-key `values`, and how to open it."""
    if config.admin_key is None:
        reason = "the admin API is closed at this front"
    elif not values:
        reason = f"no '{ADMIN_KEY_HEADER}' was sent"
    else:
        reason = f"the '{ADMIN_KEY_HEADER}' sent does not match"
    return f"{what} is not public ({reason}); {ADMIN_HINT}"


def model_refusal(config: FrontConfig, model: str) -> tuple[bool, str]:
    """Why a caller without the admin key may not use `model`: (internal?, message).

    An internal model (config.internal_models) is 403 / PERMISSION_DENIED, named as internal
    with no word on how to open it; any other name is a typo or a guess, 404 / NOT_FOUND, and
    the message lists the models this server serves.
    """
    if model in config.internal_models:
        return True, f"model {model!r} is internal"
    public = ", ".join(repr(name) for name in config.public_models)
    return False, f"unknown model {shown(model)}; this server serves {public}"


ECHO_LIMIT = 80  # characters of a client's value quoted back in an error message


def shown(value: Any, limit: int = ECHO_LIMIT) -> str:
    """`repr(value)` for an error message, cut to `limit` characters: a client's megabyte of
    model name or field name is not sent back whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({len(text)} characters)"


class Unauthorized(Exception):
    """No API key, or an unknown one (401 / UNAUTHENTICATED); the message says which."""


BEARER = "bearer "


def key_identity(config: FrontConfig, authorization: list[str]) -> str | None:
    """The identity `key:NAME` of the API key in `Authorization: Bearer KEY` values; None when
    the front has no keys (the caller's address is its identity). Unauthorized otherwise.

    Every configured key is compared in constant time, so the time taken says nothing about
    which key, or how much of one, was right.
    """
    keys = config.access.api_keys
    if not keys:
        return None
    if len(authorization) != 1 or not authorization[0].lower().startswith(BEARER):
        raise Unauthorized("an API key is required: send 'Authorization: Bearer KEY'")
    sent = authorization[0][len(BEARER) :].strip().encode("latin-1", "replace")
    found = None
    for name, key in keys:
        if hmac.compare_digest(sent, key.encode("latin-1")):
            found = name
    if found is None:
        raise Unauthorized("the API key sent is not one of this server's keys")
    return f"key:{found}"


LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})


def host_allowed(config: FrontConfig, host: str) -> bool:
    """Whether a `Host` value names this server: an IP literal, localhost (and names under
    `.localhost`), or an operator's name (FrontConfig.access.allowed_hosts; "*": any). Another
    name is what a DNS-rebinding page sends, its own name resolved to this machine."""
    allowed = config.access.allowed_hosts
    if "*" in allowed:
        return True
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return bool(name) and (
        name in LOCAL_NAMES
        or name.endswith(".localhost")
        or name in {a.lower().rstrip(".") for a in allowed}
    )


def reserved_parameter(names: Iterable[Any]) -> str | None:
    """The first request-parameter name the front reserves (a spoofing attempt), if any."""
    for name in names:
        if isinstance(name, str) and RESERVED_MARK in name.lower():
            return name
    return None


def http_identity(host: str) -> str:
    """The identity of an HTTP caller: its IP (an IPv4-mapped IPv6 address as plain IPv4)."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else host


def grpc_peer_ip(peer: str) -> str:
    """The IP address of a gRPC peer as `context.peer()` writes it (`ipv4:10.0.0.7:51234`,
    `ipv6:[::1]:51234`, the brackets sometimes %-encoded); any other form is kept whole."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host = urllib.parse.unquote(rest).rpartition(":")[0]
    return http_identity(host.strip("[]"))


RESTARTING = "a serving stage is restarting (the server reloads it by itself); retry shortly"


async def stage_ready(ready: Callable[[], bool] | None) -> bool:
    """The extra readiness check. It gates every inference call and stream message, so it is
    called inline: `ready` must be a cheap, non-blocking read (the supervisor's flag)."""
    if ready is None:
        return True
    try:
        return bool(ready())
    except Exception:  # a failing check means "not ready", never a crashed front
        return False
