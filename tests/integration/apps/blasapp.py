"""Test app: GET / runs a BLAS matmul and reports the thread pools and OS threads it saw."""

import json
import os


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
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
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
