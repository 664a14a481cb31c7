"""docs/security.md's table of the engine's routes is the app's route table: every route the
server has is listed with the auth the middleware really enforces (probed with requests without a
key, with the API key and with the operator key), public probes answer HEAD without a key, and
fault injection is absent unless the server was started to allow it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig
from qwen3_tts_engine.serving.auth import API, OPERATOR, PUBLIC
from tests.support.engine_process import free_port

ROOT = Path(__file__).resolve().parents[3]
QWEN3_TTS = Path(sys.executable).with_name("qwen3-tts")
API_KEY, OPERATOR_KEY = "route-table-api-key", "route-table-operator-key"
WHO = {"public": PUBLIC, "API key": API, "operator key": OPERATOR}


def documented_routes() -> dict[str, str]:
    """`METHOD /path` -> PUBLIC / API / OPERATOR, from docs/security.md's routes table."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("## The engine's routes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `((?:GET|POST|PUT|DELETE|PATCH) /[^`]*)` \| ([^|]+) \|", section, re.M)
    table = {}
    for route, who in rows:
        need = [v for k, v in WHO.items() if who.strip().startswith(k)]
        assert len(need) == 1, f"{route}: who may call it? {who!r}"
        table[route] = need[0]
    assert table, "no routes table in docs/security.md"
    return table


async def _server(tiny_checkpoint, **config) -> EngineServer:
    model = str(tiny_checkpoint("custom_voice"))
    server = EngineServer(Engine(model, [Handler(model)]), ServerConfig(port=0, **config))
    await server.start()
    return server


@pytest.fixture(scope="module")
async def drill_server(tiny_checkpoint):
    """Both keys, fault injection allowed: every route the server can have."""
    server = await _server(tiny_checkpoint, api_key=API_KEY, operator_key=OPERATOR_KEY,
                           allow_fault_injection=True)  # fmt: skip
    yield server
    await server.stop()


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _auth_seen(status: int) -> str:
    return {401: "no", 403: "refused"}.get(status, "yes")


async def test_the_documented_route_table_is_the_apps_and_its_auth_is_enforced(drill_server):
    routes = {f"{r.method} {r.resource.canonical}" for r in drill_server.app.router.routes()}
    gets = {r for r in routes if r.startswith("GET ")}
    assert {r for r in routes if r.startswith("HEAD ")} == {"HEAD " + r[4:] for r in gets}
    documented = documented_routes()
    assert routes - {r for r in routes if r.startswith("HEAD ")} == set(documented), (
        "docs/security.md's routes table and the app differ",
        routes ^ set(documented),
    )
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{drill_server.port}", timeout=120
    ) as c:
        for route, need in documented.items():
            method, path = route.split(" ", 1)
            # bodiless requests: a handler past auth answers 4xx without changing anything
            seen = {
                who: _auth_seen((await c.request(method, path, headers=_bearer(key))).status_code)
                for who, key in (("none", None), ("api", API_KEY), ("operator", OPERATOR_KEY))
            }
            expected = {
                PUBLIC: {"none": "yes", "api": "yes", "operator": "yes"},
                API: {"none": "no", "api": "yes", "operator": "yes"},
                OPERATOR: {"none": "no", "api": "refused", "operator": "yes"},
            }[need]
            assert seen == expected, (route, need, seen)
            if method == "GET":  # HEAD follows GET's rule
                r = await c.head(path)
                assert (r.status_code < 400) == (need == PUBLIC), (route, r.status_code)


@pytest.mark.parametrize("path", ["/health", "/ready", "/load", "/get_load", "/metrics"])
async def test_public_probes_answer_head_without_a_key(drill_server, path):
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{drill_server.port}", timeout=120
    ) as c:
        r = await c.head(path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
        # aiohttp adds no OPTIONS route: a 405 naming what is allowed, never a 401
        r = await c.options(path)
        assert r.status_code == 405 and "GET" in r.headers.get("Allow", ""), (path, r.status_code)
        assert (await c.head("/v1/models")).status_code == 401  # a keyed GET stays keyed


async def test_fault_injection_is_absent_unless_the_server_allows_it(tiny_checkpoint):
    """An engine started with only an API key: the fault route is a 404 for that key (and for
    none), and the next request is served at once, at full speed."""
    server = await _server(tiny_checkpoint, api_key=API_KEY)
    try:
        speech = {"input": "Hi.", "voice": "ryan", "max_new_tokens": 4, "response_format": "pcm"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as c:
            for key in (API_KEY, None):
                r = await c.post("/v1/engine/fault", json={"step_delay_ms": 60_000},
                                 headers=_bearer(key))  # fmt: skip
                assert r.status_code == 404, r.text
            assert all(h.step_delay_s == 0 for h in server.engine.all_handlers())
            r = await c.post("/v1/audio/speech", json=speech, headers=_bearer(API_KEY))
            assert r.status_code == 200 and len(r.content) > 0
    finally:
        await server.stop()


def test_serve_refuses_a_step_delay_without_the_flag(tmp_path):
    """`--fault-step-delay-ms` is fault injection too: refused in one line before a model loads."""
    p = subprocess.run([str(QWEN3_TTS), "serve", "--port", str(free_port()), "--model",
                        str(tmp_path / "no-such-model"), "--fault-step-delay-ms", "500"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip() == ("qwen3-tts: error: --fault-step-delay-ms is fault injection "
                                "(drills, tests): pass --allow-fault-injection too"), p.stderr  # fmt: skip
