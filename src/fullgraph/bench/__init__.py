"""`fullgraph bench`: the source documents' workloads in every variant, side by side."""

from .runner import run_workload
from .workloads import WORKLOADS

__all__ = ["WORKLOADS", "run_workload"]
