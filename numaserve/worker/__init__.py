"""The worker side: one process per slot, already bound when it starts."""
