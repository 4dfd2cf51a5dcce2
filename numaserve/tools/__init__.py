"""Operator tools beside the supervisor: load generator, latency view, profiling, doctor."""
