"""Pure control loops: data in, data out, the caller passes the clock.

- ``trend``: Theil–Sen slope + Kendall test (pure Python).
- ``leak``: leak detector (``LeakConfig`` = the ``[leak]`` section; ``LeakSettings`` its fixed tuning).
- ``admission``: the ``[admission]`` settings and the pieces the CPU gate shares with the supervisor's push.
- ``cpu_gate``: L0, the worker's CPU gate (pure).
- ``supervisor_limits``: L2 per-node loop: leases, SLO guard, Vegas mode (``LimitsSettings`` = ``[limits]``).

Nothing here starts threads, sleeps or does I/O; import the submodule you need.
"""
