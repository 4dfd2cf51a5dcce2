"""The network side: listeners, reuseport steering, NIC IRQ plans, port owners, socket diagnostics."""
