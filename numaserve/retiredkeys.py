"""Config keys and sections that were removed, with what an operator does instead.

A config file written for an older numaserve names them; loading it fails with
the reason and the replacement instead of a bare "unknown key".  Entries are
"section.key" or "section" (the whole table), each mapped to one sentence.
"""

from __future__ import annotations

_GRADIENT = ("the gradient/static limiters are gone: the CPU gate is the only worker limiter "
             "(docs/admission.md); delete the key")
_GATE_CONSTANT = "now a fixed constant of the CPU gate (numaserve/loops/admission.py); delete the key"
_LEAK_TUNING = ("now fixed (the detector's tuning, numaserve.loops.leak.LeakSettings): set leak.enabled, "
                "leak.threshold_bytes_per_1000, leak.window_requests, leak.budget_bytes or the caps instead")
_LIMITS_CONSTANT = "now a fixed constant of the limits loop (numaserve/loops/supervisor_limits.py); delete the key"

RETIRED: dict[str, str] = {
    # issue 32: one out-of-loop actuator (the worker's sentinel thread), the supervisor's door is gone
    "admission.supervisor_shed": "the worker's sentinel answers 503 from the accept queue while a "
                                 "handler blocks the loop ([admission] sentinel); delete the key",
    # issue 32: one limiter family (the CPU gate); the gradient/static limiters and their tuning are gone
    "gradient": "the gradient (L1) limiter is gone: the CPU gate sheds on loop lag and CPU wait, with no "
                "concurrency limit to tune (docs/admission.md); delete the section",
    "admission.limiter": "the CPU gate is the only limiter; for a fixed in-flight cap set [admission] "
                         "max_inflight or [limits] mode = \"static\"; delete the key",
    "admission.static_limit": "use [admission] max_inflight (a cap on requests in flight) or "
                              "`numaserve ratelimit set`; delete the key",
    "admission.queue_factor": _GRADIENT,
    "admission.queue_max": _GRADIENT,
    "admission.lifo_when_overloaded": _GRADIENT,
    "admission.codel_interval_s": _GRADIENT,
    "admission.codel_target_fraction": _GRADIENT,
    "admission.codel_target_min_s": _GRADIENT,
    "admission.codel_target_max_s": _GRADIENT,
    "admission.slough_factor": _GRADIENT,
    "admission.max_wait_factor": _GRADIENT,
    "admission.baseline_window_s": _GRADIENT,
    "admission.baseline_windows": _GRADIENT,
    "admission.lag_smoothing": _GATE_CONSTANT,
    "admission.busy_window_s": _GATE_CONSTANT,
    "admission.busy_threshold": _GATE_CONSTANT,
    "admission.busy_release": _GATE_CONSTANT,
    "admission.probe_min_s": _GATE_CONSTANT,
    "admission.probe_max_s": _GATE_CONSTANT,
    "admission.burst_fraction": _GATE_CONSTANT,
    "admission.retry_after_min_s": _GATE_CONSTANT,
    "admission.retry_after_max_s": _GATE_CONSTANT,
    "admission.throughput_tau_s": _GATE_CONSTANT,
    "limits.vegas_scaled": "Vegas always scales its thresholds to the base latency (the unscaled rule "
                           "collapsed for long service times); delete the key",
    "limits.worker_floor": _LIMITS_CONSTANT,
    "limits.node_floor": _LIMITS_CONSTANT,
    "limits.burst_fraction": _LIMITS_CONSTANT,
    "limits.slo_windows": _LIMITS_CONSTANT,
    "limits.slo_backoff": _LIMITS_CONSTANT,
    "limits.slo_release_ratio": _LIMITS_CONSTANT,
    "limits.slo_release_step": _LIMITS_CONSTANT,
    "limits.vegas_warmup_requests": _LIMITS_CONSTANT,
    "limits.vegas_min_window_requests": _LIMITS_CONSTANT,
    "limits.vegas_low_ms": _LIMITS_CONSTANT,
    "limits.vegas_high_ms": _LIMITS_CONSTANT,
    "limits.vegas_low_ratio": _LIMITS_CONSTANT,
    "limits.vegas_high_ratio": _LIMITS_CONSTANT,
    "limits.vegas_increase": _LIMITS_CONSTANT,
    "limits.vegas_decrease": _LIMITS_CONSTANT,
    "limits.vegas_rebase_s": _LIMITS_CONSTANT,
    "limits.vegas_app_limited_ratio": _LIMITS_CONSTANT,
    # issue 33 item 5: keys nobody set become fixed constants where they are used
    **{f"leak.{k}": _LEAK_TUNING
       for k in ("grace_requests", "grace_seconds", "step_requests", "min_points", "max_points", "median_width",
                 "ci_lower_bytes_per_1000", "p_value", "flattening_ratio", "quarter_fraction",
                 "quarters_required", "time_axis", "time_window_s", "time_step_s", "time_min_span_s",
                 "time_horizon_s", "time_min_bytes_per_hour", "persistence", "eval_every_requests",
                 "eval_every_seconds", "trim_before_verdict", "trim_reclaim_fraction", "soft_cap_samples",
                 "cap_metric", "use_uss", "recycle_spacing_s", "recycle_worker_min_s", "recycle_per_hour",
                 "recycle_anyway_bytes", "overload_shed_fraction", "uss_interval_s")},
    "leak.budget_memtotal_fraction": "now fixed at 0.8 of MemTotal shared by the workers: "
                                     "set leak.budget_bytes for another per-worker budget",
    "supervisor.backoff_jitter": "now fixed at ±20 % of the delay (slots that crashed together do not "
                                 "restart in step); delete the key",
    "supervisor.unresponsive_after": "now always 2 heartbeat intervals (at most supervisor.heartbeat_timeout): "
                                     "set supervisor.heartbeat_interval",
    "ops.drain_timeout": "use server.graceful_timeout (one drain time for stop, restart, reload and "
                         "recycles); `--drain-timeout` still sets it per operation",
    "ops.max_connections": "now fixed at 16 ops clients at once per socket (lowered to fit the fd limit)",
    "ops.idle_timeout": "now fixed at 30 s for an idle ops connection",
    "admin.enabled": 'set admin.bind = "" to disable the admin endpoint',
    "admin.max_connections": "now fixed at 64 admin HTTP connections (lowered to fit the fd limit)",
    "admin.idle_timeout": "now fixed at 5 s for an admin connection without a complete request",
    "cmd.probe_timeout": "now fixed at 2 s per readiness probe (the next probe asks again)",
    "cmd.probe_interval": "now fixed at 0.25 s between readiness probes",
    "cache.max_entry_bytes": "now fixed at 1 MiB (and never more than cache.max_bytes); larger responses "
                             "pass through uncached",
}


def retired(section: str, key: str | None = None) -> str | None:
    """Why ``section.key`` (or the whole ``[section]``) is gone, or None when it never existed."""
    if key is not None and f"{section}.{key}" in RETIRED:
        return RETIRED[f"{section}.{key}"]
    return RETIRED.get(section)
