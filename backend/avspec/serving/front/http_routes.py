"""Which HTTP requests the front serves, and how: the public routes and the admin fallback.

Public: health (live, ready), server metadata, and for each public model metadata, ready,
generate, generate_stream and infer; the OpenAI-compatible routes (`/v1/...`, served by the
front itself on top of generate_stream) and the playground page `/`. Anything else is refused
with 403 unless the request carries the operator's admin key, in which case it is forwarded as
is (only the front reaches Triton, so this check is the only one). Routing is on the path as
the client sent it (percent-escapes kept), the path Triton will see.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from avspec.serving.front.config import FrontConfig
from avspec.serving.front.http_status import HttpError
from avspec.serving.front.policy import admin_authorized, model_refusal, refusal, shown

_MODEL_PATH = re.compile(
    r"/v2/models/(?P<model>[^/]+)(?:/versions/[0-9]+)?"
    r"(?P<action>|/ready|/generate|/generate_stream|/infer)"
)
_MODEL_ACTIONS = {  # action -> (method, kind)
    "": ("GET", "plain"),
    "/ready": ("GET", "plain"),
    "/generate": ("POST", "generate"),
    "/generate_stream": ("POST", "generate"),
    "/infer": ("POST", "infer"),
}
_INFERENCE_ACTIONS = frozenset({"/generate", "/generate_stream", "/infer"})
_STATISTICS_PATH = "/v2/models/stats"  # Triton's statistics API, not a model named "stats"
# path -> (method, kind, inference); kinds served by the front itself
_FIXED_PATHS = {
    "/v2": ("GET", "plain", False),
    "/v2/health/live": ("GET", "live", False),
    "/v2/health/ready": ("GET", "ready", False),
    "/v1/models": ("GET", "openai_models", False),
    "/v1/completions": ("POST", "openai_completions", True),
    "/v1/chat/completions": ("POST", "openai_chat", True),
    "/": ("GET", "page", False),
}
# Kinds the front serves itself: never forwarded, whatever key a request carries.
FRONT_KINDS = frozenset({"openai_models", "openai_completions", "openai_chat", "page"})
# Kinds whose request body the front reads and checks (the rest forward theirs as is).
BODY_KINDS = frozenset({"generate", "infer", "openai_completions", "openai_chat"})


class Route(NamedTuple):
    """How the front handles a request.

    kind: "plain" (forward as is), "live" (forwarded health), "ready", "generate" (check the
    body), "infer", "page", or
    an OpenAI route ("openai_models", "openai_completions", "openai_chat").
    admin: the request carries the operator key (checked here; never forwarded).
    inference: a generation or infer call (Front.abort_inference ends it).
    """

    kind: str
    admin: bool
    inference: bool


def route(config: FrontConfig, method: str, path: str, admin_keys: list[str]) -> Route:
    """The route of a request to `path` (without its query); HttpError if it is refused."""
    admin = admin_authorized(config, admin_keys)
    model_match = _MODEL_PATH.fullmatch(path) if path != _STATISTICS_PATH else None
    inference = model_match is not None and model_match.group("action") in _INFERENCE_ACTIONS
    if path in _FIXED_PATHS:
        allowed, kind, inference = _FIXED_PATHS[path]
    elif model_match is not None:
        allowed, kind = _MODEL_ACTIONS[model_match.group("action")]
        model = model_match.group("model")
        if model not in config.public_models:
            if admin:
                return Route("plain", True, inference)
            internal, message = model_refusal(config, model)
            raise HttpError(403 if internal else 404, message)
    elif admin:
        return Route("plain", True, False)
    elif not path.startswith("/v2/"):  # not Triton's API: nothing a key would open
        raise HttpError(404, f"path {shown(path)} is not served here")
    else:
        raise HttpError(403, refusal(config, f"path {shown(path)}", admin_keys))
    if method != allowed:
        if admin and kind not in FRONT_KINDS:
            return Route("plain", True, inference)
        raise HttpError(405, f"{path} takes {allowed} only", (("Allow", allowed),))
    return Route(kind, admin, inference)
