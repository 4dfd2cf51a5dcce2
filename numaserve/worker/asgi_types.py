"""The ASGI type aliases every worker module uses (one place, so they cannot drift)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, MutableMapping

__all__ = ["ASGIApp", "Message", "Receive", "Scope", "Send"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
