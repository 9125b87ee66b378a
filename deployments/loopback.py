"""Keep a replica's inter-deployment gRPC listener on one host.

Ray Serve 2.60 starts a gRPC server in every replica, bound to ``[::]:0`` (all interfaces) with
no setting to change it; Serve only sends requests through it when handles use gRPC
(``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``), otherwise it sits idle. The server here must listen on
loopback only, so every deployment's constructor calls :func:`bind_replica_grpc` before Serve
starts that server (it does so right after the constructor returns). ``AppConfig.replica_grpc_host``
null leaves Ray's behaviour unchanged (a multi-machine cluster using gRPC handles).
"""

from __future__ import annotations


class NodeInfo:
    """Mixed into deployments: which Ray node a replica runs on (placement checks, operator views)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def bind_replica_grpc(host: str | None) -> None:
    if not host:
        return
    from ray.serve._private import replica

    original = getattr(replica.add_port_to_grpc_server, "__wrapped_by_osd__", replica.add_port_to_grpc_server)

    def on_host(server, address: str):
        if address.startswith("[::]:"):
            address = f"{host}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    on_host.__wrapped_by_osd__ = original
    replica.add_port_to_grpc_server = on_host


class _QuietTelemetry:
    """Drops Serve's access-log line of each metrics pull (every replica, every 2 s)."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("CALL telemetry ")


def replica_meter(source: str, cfg):
    """The replica's :class:`telemetry.Meter`, named after its Serve replica id (outside Serve: a
    random id, for tests that build the classes directly). Serve's access log of the pulls is muted."""
    import logging

    from telemetry import Meter

    serve_log = logging.getLogger("ray.serve")
    if not any(isinstance(f, _QuietTelemetry) for f in serve_log.filters):
        serve_log.addFilter(_QuietTelemetry())

    try:
        from ray import serve

        replica = serve.get_replica_context().replica_tag
    except Exception:  # noqa: BLE001 - not inside a replica
        replica = None
    return Meter(source, cfg, replica=replica)
