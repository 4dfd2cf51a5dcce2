"""Config keys and sections that were removed, with what an operator does instead.

A config file written for an older numaserve names them; loading it fails with
the reason and the replacement instead of a bare "unknown key".  Entries are
"section.key" or "section" (the whole table), each mapped to one sentence.
"""

from __future__ import annotations

RETIRED: dict[str, str] = {
    # issue 32: one out-of-loop actuator (the worker's sentinel thread), the supervisor's door is gone
    "admission.supervisor_shed": "removed: the worker's sentinel answers 503 from the accept queue while a "
                                 "handler blocks the loop ([admission] sentinel); delete the key",
}


def retired(section: str, key: str | None = None) -> str | None:
    """Why ``section.key`` (or the whole ``[section]``) is gone, or None when it never existed."""
    if key is not None and f"{section}.{key}" in RETIRED:
        return RETIRED[f"{section}.{key}"]
    return RETIRED.get(section)
