"""front.server: a Front runs both relays on one loop and stops cleanly, and a rule both relays
share: without an admin key the admin API is closed on HTTP and gRPC alike.
"""

from __future__ import annotations

import socket

import grpc
import pytest
from helpers.front_fakes import ADMIN_KEY, front_config, request
from tritonclient.grpc import service_pb2, service_pb2_grpc

from avspec.serving.front import Front


def test_admin_closed_without_admin_key(fake_http, fake_grpc):
    with Front(front_config(fake_http, fake_grpc)) as closed:
        headers = {"avspec-admin-key": ADMIN_KEY}
        status, payload, _ = request(closed.http_port, "GET", "/v2/models/stats", None, headers)
        with grpc.insecure_channel(f"127.0.0.1:{closed.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.RepositoryIndex(
                    service_pb2.RepositoryIndexRequest(),
                    metadata=(("avspec-admin-key", ADMIN_KEY),),
                )
    assert status == 403 and "closed" in payload["error"]
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "closed" in err.value.details()
    assert not fake_http.requests and not fake_grpc.calls


def test_stop_is_idempotent_and_closes_the_ports(fake_http, fake_grpc):
    running = Front(front_config(fake_http, fake_grpc)).start()
    port = running.http_port
    running.stop()
    running.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
