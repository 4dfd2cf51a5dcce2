"""Test only: a scaled-down leak detector in every process of one test.

``tests/integration/test_leak_recycle.py`` puts this directory first on the
supervisor's PYTHONPATH; Python imports ``sitecustomize`` at start-up, before
the config is read.  The production tuning (``numaserve.loops.leak.DETECTOR``)
needs thousands of requests and minutes; these values judge a leak within
about 1000 requests.  ``[leak]`` keys (window_requests, threshold, caps)
still apply on top, as in production.
"""

import msgspec

from numaserve.loops import leak

leak.DETECTOR = msgspec.structs.replace(
    leak.DETECTOR,
    grace_requests=200, grace_seconds=2.0,           # grace 200 requests / 2 s
    step_requests=20, min_points=12, max_points=50,  # points of 20 requests
    eval_every_requests=100, eval_every_seconds=1.0,
    time_axis=False,
    recycle_spacing_s=0.0, recycle_worker_min_s=0.0,  # recycle pacing off for the test
    uss_interval_s=2.0,
)
