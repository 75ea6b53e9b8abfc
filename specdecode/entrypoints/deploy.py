"""Replicas on Ray Serve: N engines behind the same OpenAI routes, a conversation kept on one replica.

Owns: `build_app` (the Ray Serve application: an ingress deployment in front of an engine
deployment of N replicas, fixed or autoscaled on queue length), `SessionAffinityRouter` (Ray
Serve's request-router interface: a request's session goes to the same replica while that
replica has room), the per-replica metrics merged under one ``/metrics``, and `run` (what
``specdecode serve --replicas N`` does: a local Ray cluster, the app, a drain on the first
signal).
Does not own: the OpenAI routes, validation and streaming (server.py: each replica runs the
single server's app in process, so both serve the same bytes), the engine.

Why affinity: a replica's prefix cache, its suffix trees and its datastore hits hold the
history of the conversations it served. The session is the request's ``user`` field, or else
its first messages (the system prompt and the first user turn) or the prompt's first 256
characters. Each session ranks the replicas by rendezvous hashing (no shared state: every
ingress agrees, and removing a replica moves only its own sessions); a full replica passes the
request to the next in that order.

Ray is an optional extra: ``pip install 'specdecode[ray]'``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
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


def build_app(options: dict) -> Any:
    """The Ray Serve application (``serve.run(build_app(options))``, or ``serve run
    specdecode.entrypoints.deploy:build_app`` with the options as arguments). ``options``: those
    of `run_server` (model, speculative_config, max_num_seqs, threads, ...) and ``replicas``
    (default 1), ``max_replicas`` (autoscale from ``replicas`` up to it on queue length),
    ``session_affinity`` (default True; False routes every request to the less loaded of two)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from specdecode.entrypoints.deploy_router import Engine, Ingress

    options = dict(options)
    for name in ("replicas", "max_replicas", "threads", "max_num_seqs", "max_model_len"):  # `serve run`'s are strings
        if isinstance(options.get(name), str):
            options[name] = int(options[name])
    replicas = int(options.pop("replicas", 1))
    most = options.pop("max_replicas", None)
    affinity = options.pop("session_affinity", True) not in (False, "false", "0")  # off: for comparisons
    if replicas < 1:
        raise SpecDecodeError(f"--replicas must be >= 1, got {replicas}")
    threads = options.get("threads") or 1
    scale: dict[str, Any] = {"num_replicas": replicas}
    if most is not None and int(most) > replicas:  # Ray Serve's autoscaler, on requests in flight per replica
        scale = {"autoscaling_config": {"min_replicas": replicas, "max_replicas": int(most),
                                        "target_ongoing_requests": int(options.get("max_num_seqs", 8))}}  # fmt: skip
    engine = serve.deployment(
        Engine, name="Engine", ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=4 * int(options.get("max_num_seqs", 8)),
        graceful_shutdown_timeout_s=600,  # admitted requests finish before a replica goes
        request_router_config=RequestRouterConfig(request_router_class="specdecode.entrypoints.deploy_router:SessionAffinityRouter"),
        **scale,
    ).bind(options)  # fmt: skip
    return serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                            graceful_shutdown_timeout_s=600).bind(engine, affinity)  # open streams finish too


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


def run(options: dict, host: str, port: int) -> None:
    """``specdecode serve --replicas N``: a local Ray cluster (or ``RAY_ADDRESS``'s), the app on
    ``host:port``, until SIGTERM / SIGINT; then every replica drains and the cluster stops."""
    require_ray()
    import ray
    from ray import serve

    app = build_app(options)
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, whose handlers abort the process
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name="specdecode", route_prefix="/")
        print(f"specdecode: serving on http://{host}:{port} with {options.get('replicas', 1)} replica(s) on Ray Serve",
              flush=True)  # fmt: skip
        stop.wait()
        serve.delete("specdecode")  # each replica finishes what it admitted (graceful_shutdown_timeout_s)
    finally:
        serve.shutdown()
        ray.shutdown()
