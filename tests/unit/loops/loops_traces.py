"""Synthetic RSS traces of FACTS-limits-leaks §8.2 (numpy; tests only).

RSS every 10 requests, 60,000 requests: base 120 MiB + noise σ 0.5 MiB + a
2 MiB GC sawtooth (period 700 requests) + transient +20–60 MiB spikes lasting
1–5 samples (~1 per 3,000 requests), plus the scenario's own component.
Time runs at ``RPS`` requests per second, so one sample every 0.5 s.
"""

from __future__ import annotations

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
RPS = 20.0
EVERY = 10
N_REQUESTS = 60_000

LEAK_FREE = ["flat", "warmup", "slow_warmup", "ratchet", "leak5"]
LEAKY = ["leak12", "leak20", "late12", "steps12"]


def scenario_component(name: str, r: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The scenario's memory on top of the common base, in bytes, at request counts ``r``."""
    if name == "flat":
        return np.zeros(len(r))
    if name == "warmup":  # +60 MiB, τ 800 requests
        return 60 * MiB * (1 - np.exp(-r / 800))
    if name == "slow_warmup":  # +80 MiB, τ 8,000 requests
        return 80 * MiB * (1 - np.exp(-r / 8000))
    if name == "ratchet":  # allocator high-water mark: running max of lognormal demand × 8 MiB
        return 8 * MiB * np.maximum.accumulate(rng.lognormal(0.0, 1.0, len(r)))
    if name.startswith("leak"):  # leakN: N KiB per request from the start
        return int(name[4:]) * KiB * r
    if name.startswith("late"):  # lateN: N KiB per request from request 20,000
        return int(name[4:]) * KiB * np.maximum(0, r - 20_000)
    if name.startswith("steps"):  # stepsN: +N MiB every 1,000 requests
        return int(name[5:]) * MiB * (r // 1000)
    raise ValueError(name)


def make_trace(name: str, seed: int, n_requests: int = N_REQUESTS, every: int = EVERY,
               rps: float = RPS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times s, request counts, rss bytes) for one scenario and seed."""
    rng = np.random.default_rng(seed)
    r = np.arange(0, n_requests + 1, every)
    n = len(r)
    rss = 120 * MiB + rng.normal(0.0, 0.5 * MiB, n) + 2 * MiB * ((r % 700) / 700)
    spikes = np.zeros(n)
    for start in np.nonzero(rng.random(n) < every / 3000)[0]:
        length = int(rng.integers(1, 6))
        spikes[start : start + length] = np.maximum(spikes[start : start + length], rng.uniform(20, 60) * MiB)
    rss = rss + spikes + scenario_component(name, r, rng)
    return r / rps, r, rss


def onset(name: str) -> int:
    """Request at which the leak starts (for 'detected N requests after onset')."""
    return 20_000 if name.startswith("late") else 0
