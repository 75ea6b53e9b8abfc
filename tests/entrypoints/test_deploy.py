"""Replicas on Ray Serve (a local Ray cluster, 2 replicas of a tiny model, 1 thread each): the
OpenAI client through it, streamed and not; a session stays on its replica; a replica killed
mid-request ends that request with an error while the others go on; merged metrics; bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from specdecode.entrypoints.routing import merge_metrics, rank_by_session, session_key
from tests.tiny import make_tiny_checkpoint


def test_session_key_and_rendezvous_order():
    body = lambda **kw: json.dumps({"model": "m", **kw}).encode()  # noqa: E731
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]
    assert session_key(body(user="alice", prompt="x")) == "user:alice"
    # a conversation's later turns keep its opening: the same key
    assert session_key(body(messages=chat)) == session_key(body(messages=chat + [{"role": "assistant", "content": "a"},
                                                                                 {"role": "user", "content": "q2"}]))
    assert session_key(body(messages=chat)) != session_key(body(messages=[chat[0], {"role": "user", "content": "q"}]))
    assert session_key(b"not json") is None and session_key(body()) is None
    ids = ["r1", "r2", "r3"]
    order = rank_by_session("user:alice", ids)
    assert sorted(order) == [0, 1, 2]
    # removing a replica moves only its own sessions
    for key in (f"user:{i}" for i in range(50)):
        first = ids[rank_by_session(key, ids)[0]]
        if first != "r3":
            assert ids[:2][rank_by_session(key, ids[:2])[0]] == first


def test_metrics_merge_labels_every_sample_by_replica():
    a = "# HELP x_total requests\n# TYPE x_total counter\nx_total{model=\"m\"} 3.0\n"
    b = "# HELP x_total requests\n# TYPE x_total counter\nx_total{model=\"m\"} 4.0\n"
    text = merge_metrics({"r1": a, "r2": b})
    assert text.count("# TYPE x_total counter") == 1
    assert 'x_total{model="m",replica="r1"} 3.0' in text and 'x_total{model="m",replica="r2"} 4.0' in text


def run_cli(*args: str, hide_ray: bool = False) -> subprocess.CompletedProcess:
    code = "import sys; sys.modules['ray'] = None; " if hide_ray else "import sys; "
    code += "from specdecode.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,says,hide", [
    (["--replicas", "0"], "--replicas must be >= 1", False),
    (["--replicas", "2", "--max-replicas", "1"], "--max-replicas must be >= --replicas", False),
    (["--replicas", "2"], "pip install 'specdecode[ray]'", True),
])  # fmt: skip
def test_bad_replica_flags_get_one_line(args, says, hide):
    out = run_cli("serve", "--port", "0", *args, hide_ray=hide)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray import serve

    from specdecode.entrypoints.deploy import build_app

    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("ray") / "target", "llama", seed=2,
                                    max_position_embeddings=8192))  # room for a long request to kill
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = dict(model=path, dtype="float32", device="cpu", quantization=None, threads=1, max_num_seqs=4,
                   speculative_config={"method": "ngram"}, replicas=2)  # fmt: skip
    serve.run(build_app(options), name="specdecode", route_prefix="/")
    yield path, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_openai_client_streamed_and_not_with_session_affinity(cluster):
    import httpx
    from openai import OpenAI

    path, base = cluster
    client = OpenAI(base_url=base + "/v1", api_key="none")
    out = client.completions.create(model=path, prompt="a b a b a b", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=path, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, temperature=0))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) != ""
    seen = {}
    for user in ("alice", "bob", "carol", "dave"):
        for _ in range(3):
            r = httpx.post(base + "/v1/completions", json={"model": path, "prompt": "x y", "max_tokens": 2,
                                                          "user": user}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            seen.setdefault(user, set()).add(r.headers["x-specdecode-replica"])
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    metrics = httpx.get(base + "/metrics", timeout=60).text
    assert "replica=" in metrics and "vllm:request_success_total" in metrics


def test_a_killed_replica_ends_its_request_with_an_error_and_the_others_go_on(cluster):
    """Two long streams on different replicas; one replica is killed while both run: its stream
    ends with an error event, the other runs to its last token, and the next request is served."""
    import httpx
    import ray

    path, base = cluster
    where = {}
    for i in range(40):  # two sessions on different replicas
        user = f"user{i}"
        r = httpx.post(base + "/v1/completions", json={"model": path, "prompt": "x", "max_tokens": 1, "user": user},
                       timeout=60)  # fmt: skip
        where.setdefault(r.headers["x-specdecode-replica"], user)
        if len(where) == 2:
            break
    (victim, doomed), (_, survivor) = sorted(where.items())[:2]
    body = lambda user: {"model": path, "prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True,  # noqa: E731
                         "stream_options": {"include_usage": True}, "user": user}
    # the doomed request decodes plainly to near the context: thousands of passes, so the kill
    # lands while it runs on any machine (the kill takes a fraction of a second)
    doomed_body = {**body(doomed), "max_tokens": 8000, "speculative_config": {"num_speculative_tokens": 0}}
    with httpx.stream("POST", base + "/v1/completions", json=doomed_body, timeout=120) as dying, \
            httpx.stream("POST", base + "/v1/completions", json=body(survivor), timeout=120) as living:
        assert dying.headers["x-specdecode-replica"] == victim != living.headers["x-specdecode-replica"]
        dying_lines, living_lines = dying.iter_lines(), living.iter_lines()
        assert next(dying_lines).startswith("data: ") and next(living_lines).startswith("data: ")
        name = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if victim in n["name"])
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        lost = list(dying_lines)  # ends: no hang
        kept = [line for line in living_lines if line.startswith("data: ")]
    assert any("replica_lost" in line for line in lost), lost[-3:]
    assert kept[-1] == "data: [DONE]" and not any("error" in line for line in kept)
    assert json.loads(kept[-2][6:])["usage"]["completion_tokens"] == 3000  # every token of the survivor
    deadline = time.monotonic() + 90
    while True:  # the next request is served (by the other replica, or Ray Serve's replacement)
        r = httpx.post(base + "/v1/completions", json={"model": path, "prompt": "x", "max_tokens": 2}, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
