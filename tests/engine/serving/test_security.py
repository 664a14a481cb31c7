"""The engine is no open service on a network by default: a non-loopback --host needs an API key
(or an explicit --insecure-no-auth, warned at every start), and an operator key, where one is
set, is the only key that changes the served variant."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.serving.app import EngineServer, InsecureServerError, ServerConfig
from qwen3_tts_engine.serving.auth import exposure_problem, is_loopback
from tests.support.engine_process import free_port

QWEN3_TTS = Path(sys.executable).with_name("qwen3-tts")
API_KEY, OPERATOR_KEY = "synthesis-key", "operator-key"


def _env(**keys: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("QWEN3_TTS_API_KEY", "QWEN3_TTS_OPERATOR_KEY")
    }
    return {**env, **keys}


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("", False),
    ("192.0.2.2", False), ("engine.example.com", False),
])  # fmt: skip
def test_which_hosts_are_loopback(host, loopback):
    assert is_loopback(host) is loopback
    assert (exposure_problem(host, None, None) is None) is loopback
    assert exposure_problem(host, API_KEY, None) is None  # a key makes any host fine


@pytest.mark.parametrize("host, keys", [
    ("0.0.0.0", {}), ("::", {}), ("192.0.2.2", {}), ("0.0.0.0", {"QWEN3_TTS_OPERATOR_KEY": OPERATOR_KEY}),
])  # fmt: skip
def test_serve_on_a_network_address_without_a_key_refuses_before_loading(host, keys, tmp_path):
    # the model does not exist: the refusal comes before anything loads (and nothing binds)
    p = subprocess.run([str(QWEN3_TTS), "serve", "--host", host, "--port", str(free_port()),
                        "--model", str(tmp_path / "no-such-model")],
                       capture_output=True, text=True, timeout=120, env=_env(**keys))  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"refusing to listen on {host}" in p.stderr and "QWEN3_TTS_API_KEY" in p.stderr
    assert "--insecure-no-auth" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


async def test_the_library_refuses_too(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice"))
    server = EngineServer(Engine(model, [Handler(model)]), ServerConfig(host="0.0.0.0", port=0))
    with pytest.raises(InsecureServerError, match="refusing to listen on 0.0.0.0"):
        await server.start()
    assert server.port is None and not server.engine.active.pid  # nothing bound, nothing loaded


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_insecure_no_auth_serves_every_interface_with_a_warning(tiny_checkpoint):
    """Bound to 0.0.0.0 inside a network namespace of its own (only its loopback exists), so the
    test opens nothing on this machine's network."""
    model, port = tiny_checkpoint("custom_voice"), free_port()
    probe = (f"import httpx, os, sys, time\n"
             f"for _ in range(600):  # while the server lives\n"
             f"    os.kill(int(sys.argv[1]), 0)\n"
             f"    try:\n"
             f"        r = httpx.post('http://127.0.0.1:{port}/v1/audio/speech', json={{'input': 'Hi.',"
             f" 'voice': 'ryan', 'max_new_tokens': 4, 'response_format': 'pcm'}}, timeout=120)\n"
             f"        print('status', r.status_code, len(r.content)); break\n"
             f"    except httpx.TransportError: time.sleep(0.5)\n")  # fmt: skip
    script = (f"ip link set lo up && {{ {QWEN3_TTS} serve --host 0.0.0.0 --port {port} --model {model} "
              f"--insecure-no-auth & pid=$!; {sys.executable} -c \"$PROBE\" $pid; kill -TERM $pid; wait $pid; }}")  # fmt: skip
    p = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True,
                       timeout=600, env=_env(PROBE=probe))  # fmt: skip
    if p.returncode != 0 and "unshare failed" in p.stderr:
        pytest.skip(f"no network namespaces here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "status 200" in p.stdout, (p.stdout, p.stderr[-3000:])  # no key needed: it was asked for
    assert "serving 0.0.0.0 WITHOUT an API key (--insecure-no-auth)" in p.stderr, p.stderr[-3000:]


@pytest.fixture(scope="module")
async def keyed(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice"))
    server = EngineServer(Engine(model, [Handler(model)]),
                          ServerConfig(port=0, api_key=API_KEY, operator_key=OPERATOR_KEY,
                                       allow_fault_injection=True))  # fmt: skip
    await server.start()
    yield server
    await server.stop()


async def test_only_the_operator_key_changes_the_variant(keyed):
    variant = {"variant": "8bit"}
    speech = {"input": "Hi.", "voice": "ryan", "max_new_tokens": 4, "response_format": "pcm"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{keyed.port}", timeout=120) as c:

        def auth(key):
            return {"Authorization": f"Bearer {key}"}

        r = await c.post("/v1/engine/variant", json=variant, headers=auth(API_KEY))
        assert r.status_code == 403 and "operator key" in r.json()["error"]["message"]
        r = await c.post("/v1/engine/fault", json={"step_delay_ms": 100}, headers=auth(API_KEY))
        assert r.status_code == 403 and "operator key" in r.json()["error"]["message"]
        r = await c.post("/v1/engine/fault", json={"step_delay_ms": 0}, headers=auth(OPERATOR_KEY))
        assert r.status_code == 200 and r.json()["step_delay_ms"] == 0
        assert (await c.post("/v1/engine/variant", json=variant)).status_code == 401
        assert (
            await c.post("/v1/engine/variant", json=variant, headers=auth("guess"))
        ).status_code == 401
        # past auth with the operator key: this engine has no governor to swap with
        r = await c.post("/v1/engine/variant", json=variant, headers=auth(OPERATOR_KEY))
        assert r.status_code == 409 and "governor" in r.json()["error"]["message"]
        # the API key still synthesizes and reads status; the operator key may too
        for key in (API_KEY, OPERATOR_KEY):
            r = await c.post("/v1/audio/speech", json=speech, headers=auth(key))
            assert r.status_code == 200 and len(r.content) > 0
            assert (await c.get("/v1/engine/status", headers=auth(key))).status_code == 200
        assert (await c.post("/v1/audio/speech", json=speech)).status_code == 401
        assert (await c.get("/health")).status_code == 200  # probes need no key


async def test_every_route_has_one_auth_rule_checked_before_its_handler(keyed):
    """One middleware decides every route's auth (serving/app.py ROUTE_RULES): each route the
    server has is named there, public routes answer without a key, the rest refuse one with the
    same 401 body, before any handler runs (the WebSocket's before its upgrade), counted once."""
    from prometheus_client.parser import text_string_to_metric_families

    from qwen3_tts_engine.serving.app import ROUTE_RULES
    from qwen3_tts_engine.serving.auth import PUBLIC

    routes = {
        f"{r.method} {r.resource.canonical}"
        for r in keyed.app.router.routes()
        if r.method != "HEAD"
    }
    assert routes == set(ROUTE_RULES), routes ^ set(ROUTE_RULES)

    def refused_401(text: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "qwen3_tts_requests_total" and s.labels.get("status") == "401")  # fmt: skip

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{keyed.port}", timeout=120) as c:
        before = refused_401((await c.get("/metrics")).text)
        refused = 0
        for route, need in ROUTE_RULES.items():
            method, path = route.split(" ", 1)
            r = await c.request(method, path, headers={"Connection": "Upgrade", "Upgrade": "websocket",
                                                       "Sec-WebSocket-Version": "13",
                                                       "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
                                if path.endswith("/stream") else None)  # fmt: skip
            if need == PUBLIC:
                assert r.status_code < 400, (route, r.status_code)
            else:
                assert r.status_code == 401 and r.json()["error"]["message"].startswith(
                    "missing or wrong bearer token"
                ), route
                refused += 1
        assert refused_401((await c.get("/metrics")).text) - before == refused
