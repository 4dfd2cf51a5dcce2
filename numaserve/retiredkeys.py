"""Config keys and sections that were removed, with what an operator does instead.

A config file written for an older numaserve names them; loading it fails with
the reason and the replacement instead of a bare "unknown key".  Entries are
"section.key" or "section" (the whole table), each mapped to one sentence.
"""

from __future__ import annotations

_GRADIENT = ("the gradient/static limiters are gone: the CPU gate is the only worker limiter "
             "(docs/admission.md); delete the key")
_GATE_CONSTANT = "now a fixed constant of the CPU gate (numaserve/loops/admission.py); delete the key"
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
}


def retired(section: str, key: str | None = None) -> str | None:
    """Why ``section.key`` (or the whole ``[section]``) is gone, or None when it never existed."""
    if key is not None and f"{section}.{key}" in RETIRED:
        return RETIRED[f"{section}.{key}"]
    return RETIRED.get(section)
