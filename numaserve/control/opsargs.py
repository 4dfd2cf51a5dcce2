"""The ranges of the numbers an ops request may carry, shared by the CLI and the supervisor.

One table, one checker: the CLI refuses a bad number before sending it
(exit 2 naming the option), the supervisor refuses it again for any other
client (an error reply naming the argument).  A range has a floor that
means something: ``ratelimit set 5e-324/s`` passed "finite and > 0", then
the workers' quota arithmetic overflowed and every request got a 400.
Waits for a worker's acknowledgement are bounded well below the week a
drain may take: a worker that has not acknowledged in minutes is frozen,
and an ops request must not hold its place for days.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ACK_TIMEOUT", "MAX_ACK_TIMEOUT_S", "MAX_RATE", "MAX_TIMEOUT_S", "MIN_RATE", "RATE", "TIMEOUT",
           "NumberRange"]

#: Longest timeout an ops request may ask for (a week): past that it is a typo, not a plan.
MAX_TIMEOUT_S = 7 * 86400.0
#: Longest wait for the workers' acknowledgement (``cache purge --ack-timeout``, ...).
MAX_ACK_TIMEOUT_S = 120.0
#: The slowest rate a limit can mean (one request every ~17 minutes), and the fastest.
MIN_RATE = 0.001
MAX_RATE = 1e6
#: A non-zero duration shorter than this is a typo or a denormal, not a timeout.
_MIN_SECONDS = 0.001


@dataclass(frozen=True)
class NumberRange:
    """Where a number must lie: ``minimum`` .. ``maximum`` (or exactly 0 when ``zero_ok``)."""

    minimum: float
    maximum: float
    unit: str = ""
    zero_ok: bool = False

    def describe(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        zero = "0 or " if self.zero_ok else ""
        return f"{zero}a finite number from {self.minimum:g} to {self.maximum:g}{unit}"

    def check(self, name: str, value: object) -> float:
        """``value`` as a float, or ValueError naming ``name``, the value and the range."""
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and ((self.zero_ok and value == 0) or self.minimum <= value <= self.maximum))
        if not ok:
            raise ValueError(f"{name} = {value!r}: expected {self.describe()}")
        return float(value)  # type: ignore[arg-type]


RATE = NumberRange(MIN_RATE, MAX_RATE, "requests/s")
TIMEOUT = NumberRange(_MIN_SECONDS, MAX_TIMEOUT_S, "seconds", zero_ok=True)
ACK_TIMEOUT = NumberRange(_MIN_SECONDS, MAX_ACK_TIMEOUT_S, "seconds")
