"""Guest test app: GET /alloc?mb=N allocates (once per process) and touches N MiB,
then reports which node's pages back it, as seen from inside the worker."""

import json
import os
import re
from urllib.parse import parse_qs

HELD: list[bytearray] = []


def _big_vma_pages(want_pages: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/numa_maps") as f:
        for line in f:
            m = re.search(r"\banon=(\d+)", line)
            if m and int(m.group(1)) >= want_pages * 0.9:
                for n, c in re.findall(r"\bN(\d+)=(\d+)", line):
                    out[n] = out.get(n, 0) + int(c)
    return out


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    q = parse_qs(scope.get("query_string", b"").decode())
    mb = int(q.get("mb", ["0"])[0])
    if mb and not HELD:
        buf = bytearray(mb << 20)
        buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))
        HELD.append(buf)
    body = json.dumps({
        "node": int(os.environ.get("NUMASERVE_NODE", "-1")),
        "pid": os.getpid(),
        "want_pages": (mb << 20) // 4096,
        "big_vma_pages": _big_vma_pages((mb << 20) // 4096) if mb else {},
    }).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
