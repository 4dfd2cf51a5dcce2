"""An app whose worker has almost no file descriptors left (an app that leaks fds, or a
low LimitNOFILE): at import it lowers its own soft RLIMIT_NOFILE to what it has open plus
a few, so a handful of idle connections exhausts it and accept() fails with EMFILE.

"A few" is 10: the worker opens some fds after the app's import (the admission
sentinel's listener duplicates, the loop's own), and the fd watch calls fewer than
4 free fds "at the limit"; with only 6 spare an idle worker could sit at that line
for good and the condition would never clear."""

import os
import resource

from asgi_helpers import lifespan, reply

_open = len(os.listdir("/proc/self/fd"))
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (_open + 10, _hard))


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    await reply(send, {"pid": os.getpid()})
