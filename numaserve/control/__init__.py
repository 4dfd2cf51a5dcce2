"""Supervisor ↔ worker and ops CLI ↔ supervisor control plane (ZeroMQ + msgspec)."""
