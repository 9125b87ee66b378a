"""Metrics of the running application: what each replica counts (:class:`Meter`), the one place
where the replicas' counts are added up and exported (:class:`Hub`), and the catalogue of metric
names both use (:mod:`telemetry.catalog`). Ray-free: the deployments only carry snapshots."""

from .catalog import CATALOG, Family
from .hub import Hub
from .meter import Meter

__all__ = ["CATALOG", "Family", "Hub", "Meter"]
