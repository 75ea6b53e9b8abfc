"""What the Ray Serve replicas need without Ray: the session a request belongs to, the order of
the replicas for it, the merged metrics, and one HTTP request run through an app in process.

Owns: `session_key`, `rank_by_session` (rendezvous hashing), `merge_metrics`, `call_asgi`, the
error a request gets when its replica is lost, and `require_ray` (the one line that names the
extra to install).
Does not own: the deployments, the router and the cluster (deploy.py, which needs Ray).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any, AsyncIterator

from specdecode.config import SpecDecodeError

REPLICA_HEADER = "x-specdecode-replica"
HUB = "specdecode-metrics"  # the named actor the replicas leave their metrics with


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise SpecDecodeError("--replicas runs the engines on Ray Serve, which is not installed: "
                              "pip install 'specdecode[ray]'") from None  # fmt: skip


def session_key(body: bytes) -> str | None:
    """The conversation a request belongs to: its ``user``, else its opening, hashed."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("user"), str) and request["user"]:
        return "user:" + request["user"]
    messages = request.get("messages")
    if isinstance(messages, list) and messages:
        opening = json.dumps(messages[:2], sort_keys=True, default=str)
    elif isinstance(request.get("prompt"), str):
        opening = request["prompt"][:256]
    else:
        return None
    return "open:" + hashlib.sha1(opening.encode()).hexdigest()


def rank_by_session(key: str, replica_ids: list[str]) -> list[int]:
    """Indices of ``replica_ids`` in rendezvous-hashing order for ``key`` (highest weight first)."""
    weight = [hashlib.sha1(f"{key}|{rid}".encode()).digest() for rid in replica_ids]
    return sorted(range(len(replica_ids)), key=lambda i: weight[i], reverse=True)


def merge_metrics(texts: dict[str, str]) -> str:
    """Each replica's Prometheus text, one family per metric, every sample labelled by replica."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                merged.samples.append(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp))

    class Merged:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry).decode()


async def call_asgi(app: Any, method: str, path: str, query: str, headers: list[tuple[str, str]],
                    body: bytes) -> AsyncIterator[Any]:  # fmt: skip
    """Run one HTTP request through the ASGI ``app`` in process: yields (status, headers), then
    the body's chunks as the app sends them. Closing the iterator tells the app the client left."""
    sent: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    asked = False

    async def receive() -> dict:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("replica", 80)}  # fmt: skip
    task = asyncio.create_task(app(scope, receive, sent.put))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # the app ended without finishing its response: raise what it raised
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        left.set()
        await asyncio.wait([task], timeout=30)


def lost_replica(e: BaseException) -> dict:
    return {"error": {"message": f"the replica serving this request stopped: {type(e).__name__}", "type": "server_error",
                      "param": None, "code": "replica_lost"}}  # fmt: skip


async def rest_of_stream(stream: Any) -> AsyncIterator[bytes]:
    """The body's chunks; a replica lost mid-stream ends the stream with an error event."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as e:
        yield f"data: {json.dumps(lost_replica(e))}\n\ndata: [DONE]\n\n".encode()
