"""Binding workers to their node: placement plan, launch trampoline, NUMA syscalls, verification, worker env."""
