"""The front: the only public door to the Triton server, on HTTP, gRPC and metrics.

Exposure model (avspec.serving.exposure)
----------------------------------------
tritonserver's HTTP and gRPC are Unix sockets in a directory only the server's user may enter,
its metrics a loopback port: only the front (and the launcher's own calls) reach it, so Triton
restricts nothing by key and no key is on any command line.

The front listens on the public address and forwards only:

* health (live, ready) and server metadata;
* for each public model: metadata, ready, generate, generate_stream and infer (HTTP), or
  ModelMetadata, ModelReady, ModelInfer and ModelStreamInfer (gRPC);
* the OpenAI-compatible routes `/v1/models`, `/v1/completions`, `/v1/chat/completions`, which
  the front serves itself on top of generate_stream (front.openai);
* `GET /metrics` on the metrics port (metrics_relay).

A model the server loads but does not publish is refused with 403 / PERMISSION_DENIED, an
unknown one with 404 / NOT_FOUND; anything else (repository, config, statistics, trace,
logging, shared memory) with 403, unless the front was given the operator's admin key and the
request carries it: then it is forwarded as is (the key itself is not).

On every forwarded call the front sets the caller's identity `avspec-client` (the model uses it
for per-client fairness; see policy for what an identity is: an API key's name when the operator
configured keys, else the address). With keys, calls other than health need one (401 /
UNAUTHENTICATED). Whatever a client sends in any
header or metadata key containing `avspec` is dropped, and request parameters (or generate
fields) named `avspec-*` are refused, so the identity cannot be spoofed.

HTTP is parsed by aiohttp on both sides (server for clients, client session to Triton; why
aiohttp: http_relay); the front keeps only its rules. There is no hand-written HTTP parsing.

Modules: schema (generate body schema and validation), config (FrontConfig), policy (admin
authorisation, refusal texts, reserved names, identity), limits (connections and streams per IP
address and in total; health is never refused), inflight (calls that Front.abort_inference
ends); HTTP: http_routes (what is public), http_status (status codes, error answers),
http_connection (per-connection caps and timeouts on aiohttp's protocol), http_upstream (the
client to Triton), http_relay (the public port), openai (the /v1 routes); grpc_relay (gRPC),
metrics_relay (the metrics port), server (Front: the relays on one event loop in a background
thread).
"""

from avspec.serving.front.config import FrontConfig
from avspec.serving.front.schema import (
    DEFAULT_GENERATE_SCHEMA,
    GenerateSchema,
    InputSpec,
    check_generate_body,
    generate_schema_from_config,
)
from avspec.serving.front.server import Front

__all__ = [
    "DEFAULT_GENERATE_SCHEMA",
    "Front",
    "FrontConfig",
    "GenerateSchema",
    "InputSpec",
    "check_generate_body",
    "generate_schema_from_config",
]
