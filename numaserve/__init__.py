"""numaserve: a NUMA-aware serving supervisor for Python workloads."""

__version__ = "0.1.0"
