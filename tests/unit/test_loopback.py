"""A replica's inter-deployment gRPC listener kept on loopback, with a real gRPC server and the
kernel's table of listening sockets; the replicas' meters outside Serve."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path

import grpc

from config import MetricsConfig
from deployments.loopback import _QuietTelemetry, bind_replica_grpc, replica_meter


def listening_on(port: int) -> set[str]:
    """Addresses with a TCP socket listening on ``port`` (/proc/net/tcp and tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                names = {"0100007F": "127.0.0.1", "00000000": "0.0.0.0",  # IPv4, and IPv6 with v4 mapped:
                         "0000000000000000FFFF00000100007F": "127.0.0.1", "0" * 32: "::"}
                out.add(names.get(addr, addr))
    return out


def test_a_replicas_grpc_listener_binds_loopback_only(monkeypatch):
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    monkeypatch.setattr(replica, "add_port_to_grpc_server", original)  # put back after the test
    bind_replica_grpc("127.0.0.1")
    bind_replica_grpc("127.0.0.1")  # a second replica in the process: wrapped once, not twice
    patched = replica.add_port_to_grpc_server
    assert patched is not original and patched.__wrapped_by_osd__ is original
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        port = patched(server, "[::]:0")  # what Serve asks for: every interface
        assert port > 0 and listening_on(port) == {"127.0.0.1"}
        other = patched(server, "127.0.0.1:0")  # any other address is left as asked
        assert other > 0 and listening_on(other) == {"127.0.0.1"}
    finally:
        server.stop(0)


def test_without_a_host_rays_listener_is_left_alone(monkeypatch):
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    monkeypatch.setattr(replica, "add_port_to_grpc_server", original)
    bind_replica_grpc(None)
    bind_replica_grpc("")
    assert replica.add_port_to_grpc_server is original


def test_a_meter_outside_serve_and_the_muted_telemetry_calls():
    m = replica_meter("Router", MetricsConfig(enabled=False))
    assert m.source == "Router" and m.replica.startswith("Router-") and not m.enabled
    replica_meter("Ingress", MetricsConfig())
    serve_log = logging.getLogger("ray.serve")
    assert sum(isinstance(f, _QuietTelemetry) for f in serve_log.filters) == 1  # added once
    record = logging.LogRecord("ray.serve", logging.INFO, __file__, 1, "CALL telemetry OK 1.2ms", None, None)
    assert not _QuietTelemetry().filter(record)
    record.msg = "CALL stream OK 12ms"
    assert _QuietTelemetry().filter(record)
