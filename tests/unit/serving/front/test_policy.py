"""front.policy: a caller's address as both relays use it: an HTTP caller's identity is its IP (an
IPv4-mapped IPv6 address as plain IPv4), a gRPC peer's IP is its address without the port.
"""

from __future__ import annotations

import pytest

from avspec.serving.front.policy import grpc_peer_ip, http_identity


@pytest.mark.parametrize(
    ("host", "identity"),
    [
        ("10.0.0.7", "10.0.0.7"),
        ("::ffff:10.0.0.7", "10.0.0.7"),  # a dual-stack listener's view of an IPv4 client
        ("2001:db8::1", "2001:db8::1"),
        ("fe80::1%eth0", "fe80::1%eth0"),
    ],
)
def test_http_identity_is_the_ip(host, identity):
    assert http_identity(host) == identity


@pytest.mark.parametrize(
    ("peer", "ip"),
    [
        ("ipv4:10.0.0.7:51234", "10.0.0.7"),
        ("ipv6:[2001:db8::1]:51234", "2001:db8::1"),
        ("ipv6:%5B::ffff:10.0.0.7%5D:51234", "10.0.0.7"),  # brackets %-encoded, IPv4-mapped
        ("unix:/run/x.sock", "unix:/run/x.sock"),
    ],
)
def test_grpc_peer_ip_drops_the_port(peer, ip):
    assert grpc_peer_ip(peer) == ip
