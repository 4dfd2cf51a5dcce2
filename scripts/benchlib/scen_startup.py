"""Scenario 6: start-up time to ready (2 workers).

From spawning the server's command until (a) the port answers a first 200
and (b) every worker is ready: numaserve's ``status`` shows every slot
``ready`` (its workers report ready only after the app imported and the
listener is served); uvicorn's and gunicorn's workers each log uvicorn's
"Application startup complete.".  (b) is what a rolling deploy should wait
for; (a) is when the first user can be served.
"""

from __future__ import annotations

from typing import Any

from benchlib.common import Ctx, summarize_rows
from benchlib.servers import Server, ServerConfig

KEYS = ("first_answer_s", "all_ready_s")


def run(ctx: Ctx) -> dict[str, Any]:
    reps = ctx.pick(1, max(ctx.reps, 5))
    raw: dict[str, list[dict[str, Any]]] = {}
    for rep in range(reps):
        for kind in ctx.order(rep):
            with Server(ServerConfig(kind, workers=2)).start() as srv:
                row = srv.wait_ready(timeout=120.0)
            raw.setdefault(kind, []).append(row)
            ctx.log(f"startup rep {rep + 1} {kind:9} first answer {row['first_answer_s']} s, "
                    f"all ready {row['all_ready_s']} s")
    return {
        "title": "Start-up time to ready (2 workers)",
        "params": {"workers": 2, "reps": reps},
        "rows": [{"server": k, "reps": v, **summarize_rows(v, KEYS)} for k, v in raw.items()],
    }
