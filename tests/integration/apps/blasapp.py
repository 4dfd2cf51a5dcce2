"""Test app: GET / runs a BLAS matmul and reports the thread pools and OS threads it saw."""

import json
import os

from asgi_helpers import lifespan, reply


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    import numpy as np
    from threadpoolctl import threadpool_info

    a = np.ones((400, 400))
    (a @ a).sum()
    body = json.dumps({
        "slot": int(os.environ["NUMASERVE_SLOT"]),
        "pid": os.getpid(),
        "pools": [{"api": p["internal_api"], "num_threads": p["num_threads"]} for p in threadpool_info()],
        "os_threads": len(os.listdir("/proc/self/task")),
    }).encode()
    await reply(send, body, b"application/json")
