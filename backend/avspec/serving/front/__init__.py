"""The front: the only public door to the Triton server, on HTTP and gRPC.

Exposure model (avspec.serving.exposure)
----------------------------------------
tritonserver binds its HTTP and gRPC ports on 127.0.0.1 only, with restricted APIs:

* `inference` (infer, generate, generate_stream) requires the per-boot front key, which only the
  front knows, so every inference call passes through here (header `avspec-front-key`; over
  gRPC Triton expects it as `triton-grpc-protocol-avspec-front-key`);
* the admin APIs (model repository, model config, statistics, shared memory, trace, logging)
  require the operator's admin key (`avspec-admin-key`, over gRPC with the same prefix);
* health and metadata are open.

The front listens on the public address and forwards only:

* health (live, ready) and server metadata;
* for each public model: metadata, ready, generate, generate_stream and infer (HTTP), or
  ModelMetadata, ModelReady, ModelInfer and ModelStreamInfer (gRPC).

Anything else (other models, repository, config, statistics, trace, logging, shared memory) is
refused with 403 / PERMISSION_DENIED, unless the front was given an admin key and the request
carries it; then it is forwarded as is and Triton checks the key again.

On every forwarded call the front sets the caller's identity `avspec-client` (the model uses it
for per-client fairness; see policy for what an identity is) and the front key. Whatever a client
sends in any header or metadata key containing `avspec` is dropped, and request parameters (or
generate fields) named `avspec-*` are refused, so neither value can be spoofed.

Modules: schema (generate body schema and validation), config (FrontConfig), policy (admin
authorisation, refusal texts, reserved names, identity), inflight (calls that
Front.abort_inference ends), http_wire and http_relay (HTTP), grpc_relay (gRPC), server (Front:
both relays on one event loop in a background thread).
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
