"""The pieces of the server's responses that outlive a route: the SSE response that cancels its
request however it ends, an SSE line, waiting for a client to go away, and cancelling a
request's choices. The routes are server.py's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdecode.entrypoints.choices import Choice


def cancel(choices: Sequence[Choice]) -> None:
    for c in choices:
        c.cancel()


class EventStream(StreamingResponse):
    """SSE whose ``on_close`` runs however the response ends. Starlette cancels the sending task
    on disconnect, which leaves the body generator suspended at a ``yield`` (its ``finally`` would
    wait for garbage collection); this closes it and cancels the request at once."""

    def __init__(self, content: AsyncIterator[str], on_close: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


def sse_line(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
