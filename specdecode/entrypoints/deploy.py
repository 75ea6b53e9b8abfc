"""Replicas on Ray Serve: N engines behind the same OpenAI routes, a conversation kept on one replica.

Owns: `build_app` (the Ray Serve application: an `Ingress` deployment that forwards each HTTP
request whole to one of N `Engine` replicas, fixed or autoscaled on queue length),
`SessionAffinityRouter` (Ray Serve's request-router interface: a request's session goes to the
same replica while that replica has room), `MetricsHub` (where the replicas leave their
metrics; ``/metrics`` merges them) and `run` (what ``specdecode serve --replicas N`` does: a
local Ray cluster, the app, a drain on the first signal).
Does not own: the OpenAI routes, validation and streaming (server.py: each replica runs the
single server's app in process, so both serve the same bytes), the session key, the metrics
merge and the in-process HTTP call (routing.py), the engine.

Why affinity: a replica's prefix cache, its suffix trees and its datastore hits hold the
history of the conversations it served. Each session ranks the replicas by rendezvous hashing
(no shared state: every ingress agrees, and removing a replica moves only its own sessions); a
full replica passes the request to the next in that order.

Ray is an optional extra: ``pip install 'specdecode[ray]'``.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdecode.config import SpecDecodeError
from specdecode.entrypoints.routing import (
    HUB, REPLICA_HEADER, call_asgi, lost_replica, merge_metrics, rank_by_session, rest_of_stream, session_key,
)  # fmt: skip


@ray.remote(num_cpus=0)
class MetricsHub:
    """Each replica's latest Prometheus text, by replica."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = text

    def get(self) -> dict[str, str]:
        return dict(self.texts)


def metrics_hub() -> Any:
    """The one hub of the application, whoever asks first creates it."""
    return MetricsHub.options(name=HUB, namespace="serve", get_if_exists=True, lifetime="detached").remote()


class SessionAffinityRouter(RequestRouter):
    """A request with a session goes to the replicas in that session's rendezvous order, the
    first with room first; one without goes to the less loaded of two at random."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = (pending_request.kwargs or {}).get("session") if pending_request is not None else None
        room = self.select_available_replicas(candidate_replicas) or candidate_replicas
        if key is None:
            return [random.sample(room, min(2, len(room)))]
        order = rank_by_session(key, [r.replica_id.unique_id for r in candidate_replicas])
        has_room = {r.replica_id for r in room}
        ranked = [candidate_replicas[i] for i in order]
        return [[r] for r in ranked if r.replica_id in has_room] + [[r] for r in ranked if r.replica_id not in has_room]


@serve.ingress()
class Ingress:
    """The routes in front of the engine replicas."""

    def __init__(self, engine: Any, affinity: bool) -> None:
        self.engine, self.affinity = engine, affinity
        self.hub = metrics_hub()

    def __serve_build_asgi_app__(self) -> Any:
        api = FastAPI(title="specdecode (Ray Serve)")

        @api.get("/metrics")
        async def metrics() -> Response:
            return Response(merge_metrics(await self.hub.get.remote()), media_type="text/plain; version=0.0.4")

        @api.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            body = await request.body()
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
            session = session_key(body) if self.affinity else None
            stream = self.engine.options(stream=True).handle.remote(
                request.method, "/" + path, request.url.query, headers, body, session=session)
            try:
                status, out_headers = await stream.__anext__()
            except Exception as e:  # the replica died before it answered
                return JSONResponse(lost_replica(e), status_code=503)
            return StreamingResponse(rest_of_stream(stream), status_code=status, headers=dict(out_headers))

        return api


class Engine:
    """One replica: loads the model and serves the OpenAI app in process (server.py)."""

    def __init__(self, options: dict) -> None:
        import torch

        from specdecode.drafters.registry import parse_spec
        from specdecode.entrypoints.serve import build_server_app
        from specdecode.model.loader import load_model

        torch.set_num_threads(int(options.get("threads") or 1))
        target = load_model(options.get("model"), dtype=options.get("dtype", "auto"),
                            device=options.get("device", "auto"), quantization=options.get("quantization", "auto"),
                            progress=False)  # fmt: skip
        self.app = build_server_app(
            target, parse_spec(options.get("speculative_config", "auto")), model=options.get("model"),
            max_model_len=options.get("max_model_len"), max_num_seqs=int(options.get("max_num_seqs", 8)),
            quantization=options.get("quantization", "auto"), threads=options.get("threads"),
            enable_prefix_caching=options.get("enable_prefix_caching", True), api_key=options.get("api_key"),
        )  # fmt: skip
        self.engine_thread = self.app.state.server.engine_thread
        self.engine_thread.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.hub = metrics_hub()

    async def handle(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                     session: str | None = None) -> AsyncIterator[Any]:  # fmt: skip
        """The app's answer: (status, headers) with this replica's id, then the body's chunks."""
        try:
            async for item in call_asgi(self.app, method, path, query, headers, body):
                if isinstance(item, tuple):
                    item = (item[0], item[1] + [(REPLICA_HEADER, self.replica)])
                yield item
        finally:
            await self._report()

    async def _report(self) -> None:
        chunks = [c async for c in call_asgi(self.app, "GET", "/metrics", "", [], b"") if isinstance(c, bytes)]
        self.hub.put.remote(self.replica, b"".join(chunks).decode())

    async def check_health(self) -> None:  # Ray Serve's health check: the engine thread is alive
        if not self.engine_thread.is_alive():
            raise RuntimeError("the engine thread stopped")

    def __del__(self) -> None:  # after Ray Serve's graceful wait: whatever is still admitted finishes
        self.engine_thread.stop(timeout=600)


def build_app(options: dict) -> Any:
    """The Ray Serve application (``serve.run(build_app(options))``, or ``serve run
    specdecode.entrypoints.deploy:build_app`` with the options as arguments). ``options``: those
    of `run_server` (model, speculative_config, max_num_seqs, threads, ...) and ``replicas``
    (default 1), ``max_replicas`` (autoscale from ``replicas`` up to it on queue length),
    ``session_affinity`` (default True; False routes every request to the less loaded of two)."""
    from ray.serve.config import RequestRouterConfig

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
        request_router_config=RequestRouterConfig(request_router_class="specdecode.entrypoints.deploy:SessionAffinityRouter"),
        **scale,
    ).bind(options)  # fmt: skip
    return serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                            graceful_shutdown_timeout_s=600).bind(engine, affinity)  # open streams finish too


def run(options: dict, host: str, port: int) -> None:
    """``specdecode serve --replicas N``: a local Ray cluster (or ``RAY_ADDRESS``'s), the app on
    ``host:port``, until SIGTERM / SIGINT; then every replica drains and the cluster stops."""
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
