"""Pure control loops: data in, data out, the caller passes the clock.

- ``trend``: Theil–Sen slope + Kendall test (pure Python).
- ``leak``: leak detector (``LeakSettings`` = the ``[leak]`` section).
- ``gradient``: L1 worker concurrency controller (``GradientSettings``).
- ``admission``: L0 worker admission gate, pure machine + asyncio wrapper (``AdmissionSettings``).
- ``supervisor_limits``: L2 per-node loop: leases, SLO guard, Vegas mode (``LimitsSettings`` = ``[limits]``).

Nothing here starts threads, sleeps or does I/O; import the submodule you need.
"""
