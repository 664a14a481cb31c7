"""The browser client: `voice-agent web` (page + token endpoint) and a real call from Chromium.

The fast tests run the aiohttp app in-process with a made-up key pair: the token's grants, bad
input (4xx JSON), a missing livekit-client build, and that the API secret reaches no response.
The slow test is the call test of `test_livekit_call.py` with a browser as the caller: a LiveKit
server, the scripted LLM, the TTS engine, a `voice-agent start` worker and a `voice-agent web`
server run on 127.0.0.1; `tests/support/browser/call.mjs` (playwright-core) drives Debian's Chromium
through the page: Join (into a room the server picks: by default the page has no room field),
the agent's subscription to the microphone, whose track then plays an espeak-ng question from a
WAV file, the user's transcript, the agent's transcript, audible agent audio and the page's
latency readout. Every wait is for an event, bounded by a hang guard; times are compared only
on one clock (the page's, or the worker's against the page's readings as intervals that contain
it).

Needs `scripts/install_browser.sh` (Debian chromium; npm ci for livekit-client and
playwright-core). Without it the browser test is skipped with the reason, or fails when CI is set.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer
from livekit import api

from tests.support.engine_process import EngineProcess, free_port
from tests.support.livekit_server import livekit_server  # noqa: F401 (the fixture)
from tests.system.test_livekit_call import (
    QUESTION,
    _delete_room,
    _start_worker,
    _stop_worker,
    _until,
)
from voice_agent import web_client
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import pad_silence, read_wav, speech_wav
from voice_agent.settings import WebSettings

pytestmark = pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long")  # devkey/secret
REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "support" / "browser" / "call.mjs"
PLAYWRIGHT = (
    REPO / "tests" / "support" / "browser" / "node_modules" / "playwright-core" / "package.json"
)
INSTALL_HINT = (
    "run scripts/install_browser.sh (Debian chromium, npm ci for the page and the driver)"
)
SECRET = "fake-api-secret-for-the-web-tests-0123456789"  # long enough for HMAC-SHA256
WORDS = ("time",)  # of QUESTION: tiny.en on Opus-coded audio hears "time", not always "what"
AGENT_WORDS = ("noon",)  # of the scripted LLM's answer
BROWSER_TIMEOUT = 300  # seconds for call.mjs from launch to the latency readout: a hang guard


def _settings(**kw) -> WebSettings:
    base = dict(livekit_url="ws://127.0.0.1:7880", livekit_api_key="webtestkey",
                livekit_api_secret=SECRET)  # fmt: skip
    return WebSettings(**{**base, **kw})


# --- the app, in-process ------------------------------------------------------------------------


async def test_token_endpoint_grants_and_secrecy():
    settings = _settings(web_livekit_url="wss://lk.example.test")
    async with TestClient(TestServer(web_client.create_app(settings))) as client:
        r = await client.post("/api/token", json={})
        text = await r.text()
        assert r.status == 200 and r.headers["Cache-Control"] == "no-store", text
        assert SECRET not in text
        body = json.loads(text)
        assert set(body) == {"url", "token", "room", "identity"}
        assert body["url"] == "wss://lk.example.test"  # the browser's URL, not LIVEKIT_URL
        claims = api.TokenVerifier("webtestkey", SECRET).verify(body["token"])
        assert claims.identity == body["identity"] and claims.identity.startswith("web-")
        assert claims.video.room == body["room"] and body["room"].startswith("web-")
        assert claims.video.room_join and claims.video.can_subscribe
        assert claims.video.can_publish_sources == ["microphone"]
        assert not claims.video.room_admin and not claims.video.room_create

        second = await (await client.post("/api/token")).json()  # no body at all
        assert second["identity"] != body["identity"] and second["room"] != body["room"]

        named = await client.post("/api/token", json={"room": "my-room.1"})
        assert (
            named.status == 403
        )  # the server picks the room (tests/agent/test_web_token_security.py)

        for page in ("/", "/app.js", "/style.css", "/api/config"):
            r = await client.get(page)
            assert r.status == 200, page
            assert SECRET not in await r.text(), page
            assert "default-src 'self'" in r.headers["Content-Security-Policy"]

    # named rooms allowed, occupied ones too (no LiveKit server is asked): the name is granted
    settings = _settings(web_allow_room_names=True, web_allow_occupied_rooms=True)
    async with TestClient(TestServer(web_client.create_app(settings))) as client:
        given = await (await client.post("/api/token", json={"room": "my-room.1"})).json()
        claims = api.TokenVerifier("webtestkey", SECRET).verify(given["token"])
        assert given["room"] == claims.video.room == "my-room.1"
        assert SECRET not in json.dumps(given)


@pytest.mark.parametrize("body, status, says", [
    ({"room": "x" * 65}, 400, "1-64 characters"),
    ({"room": "../admin"}, 400, "1-64 characters"),
    ({"room": "a room"}, 400, "1-64 characters"),
    ({"room": 7}, 400, "1-64 characters"),
    ({"room": "ok", "identity": "admin"}, 400, "unknown field"),
    (["room"], 400, "JSON object"),
    ("{not json", 400, "not JSON"),
    ("x" * 5000, 413, "bytes"),
])  # fmt: skip
async def test_token_endpoint_rejects_bad_input(body, status, says):
    async with TestClient(TestServer(web_client.create_app(_settings()))) as client:
        if isinstance(body, str):
            r = await client.post(
                "/api/token", data=body, headers={"Content-Type": "application/json"}
            )
        else:
            r = await client.post("/api/token", json=body)
        error = (await r.json())["error"]
        assert r.status == status and error["code"] == status, error
        assert says in error["message"]


async def test_missing_livekit_client_build_says_how_to_install(tmp_path):
    settings = _settings(web_client_js=str(tmp_path / "missing.umd.js"))
    async with TestClient(TestServer(web_client.create_app(settings))) as client:
        r = await client.get("/livekit-client.umd.js")
        assert r.status == 500
        assert "npm ci --prefix agent/voice_agent/web" in await r.text()


def test_missing_settings_are_config_errors():
    with pytest.raises(web_client.ConfigError, match="LIVEKIT_API_SECRET"):
        web_client.create_app(_settings(livekit_api_secret=None))
    with pytest.raises(web_client.ConfigError, match="not a ws://"):
        web_client.create_app(_settings(livekit_url="127.0.0.1:7880"))


def test_web_command_without_credentials_exits_nonzero(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVEKIT_")}
    exe = str(Path(sys.executable).with_name("voice-agent"))
    p = subprocess.run([exe, "web", "--web-port", str(free_port())], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET not set" in p.stderr
    assert "Traceback" not in p.stderr


# --- a real call from Chromium -------------------------------------------------------------------


def chromium_path() -> Path:
    return Path(os.environ.get("CHROMIUM_BIN") or shutil.which("chromium") or "/usr/bin/chromium")


def browser_tools_problem() -> str | None:
    """Why the browser test cannot run here (None: it can)."""
    if shutil.which("node") is None:
        return "no `node` (Node.js) on PATH"
    if not (chromium_path().is_file() and os.access(chromium_path(), os.X_OK)):
        return f"no Chromium at {chromium_path()} (set CHROMIUM_BIN for another one)"
    if not PLAYWRIGHT.is_file():
        return f"playwright-core is not installed ({PLAYWRIGHT.parent} is missing)"
    if not web_client.CLIENT_JS.is_file():
        return f"livekit-client is not installed ({web_client.CLIENT_JS} is missing)"
    return None


def require_browser_tools() -> None:
    """Skip with the reason, like the LiveKit server fixture; under CI, fail instead."""
    problem = browser_tools_problem()
    if problem is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI is set and the browser test cannot run: {problem}: {INSTALL_HINT}")
    pytest.skip(f"{problem}: {INSTALL_HINT}")


@pytest.fixture(scope="session")
def browser_tools() -> None:
    """Session-scoped and listed first, so that it skips before the servers start."""
    require_browser_tools()


def _question_wav(path: Path) -> Path:
    """The question at 48 kHz, 16-bit mono, with a little silence around it; call.mjs plays it
    once into the microphone when the agent has subscribed to it (silence follows it there)."""
    samples, rate = read_wav(speech_wav(QUESTION, sample_rate=48000))
    samples = pad_silence(samples, rate, before=0.5, after=0.5)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return path


def _start_web(env: dict[str, str], cwd: Path, port: int, log: Path) -> subprocess.Popen:
    exe = str(Path(sys.executable).with_name("voice-agent"))
    with open(log, "wb") as fh:
        return subprocess.Popen([exe, "web", "--web-port", str(port)], cwd=cwd, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left of it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _drive_browser(url: str, wav: Path, room: str, screenshot: Path, log: Path) -> dict:
    """Run call.mjs in its own process group (Chromium included); its JSON result."""
    cmd = ["node", str(DRIVER), "--url", url, "--wav", str(wav), "--room", room,
           "--words", ",".join(WORDS), "--agent-words", ",".join(AGENT_WORDS),
           "--screenshot", str(screenshot),
           "--chromium", str(chromium_path()), "--timeout", str(BROWSER_TIMEOUT)]  # fmt: skip
    # no LD_PRELOAD (a user may still preload OpenBLAS for mlx by hand): a preloaded OpenBLAS breaks thread creation
    # in node and Chromium (node: "pthread_create: Invalid argument"; Chromium's pages crash)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=BROWSER_TIMEOUT + 30)
        except subprocess.TimeoutExpired:
            _stop_group(proc, grace=0)
            raise AssertionError(f"call.mjs did not finish in {BROWSER_TIMEOUT + 30}s") from None
        finally:
            if proc.poll() is None:
                _stop_group(proc, grace=0)
    lines = out.decode(errors="replace").strip().splitlines()
    if not lines:
        raise AssertionError(f"call.mjs printed nothing (exit {proc.returncode}): "
                             f"{log.read_text(errors='replace')[-2000:]}")  # fmt: skip
    result = json.loads(lines[-1])
    result["exit_code"] = proc.returncode
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)  # hang guards: the worker's start (120 s), the browser's call (300 s)
async def test_call_from_chromium(browser_tools, livekit_server, tiny_checkpoint, tmp_path,  # noqa: F811
                                  record_property):  # fmt: skip
    server = livekit_server
    t_start = time.monotonic()
    engine = EngineProcess(tiny_checkpoint("custom_voice"), None, "--no-governor")
    engine_started = asyncio.create_task(asyncio.to_thread(engine.start))
    lk_env = {"LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.api_key,
              "LIVEKIT_API_SECRET": server.api_secret}  # fmt: skip
    web_port = free_port()
    web_url = f"http://127.0.0.1:{web_port}"
    screenshot = tmp_path / "browser-call.png"
    llm = web = worker = None
    log = tmp_path / "worker.log"
    result: dict = {}
    try:  # everything started here stops in `finally`, whatever fails
        llm = await ScriptedChatServer().start()
        web = _start_web({**os.environ, **lk_env}, tmp_path, web_port, tmp_path / "web.log")
        wav = _question_wav(tmp_path / "question.wav")
        await engine_started
        env = {**os.environ, **lk_env, "TTS_URL": engine.url, "LLM_BASE_URL": llm.url,
               "LLM_MODEL": "scripted", "TTS_MAX_NEW_TOKENS": "6", "VOICE_AGENT_OFFLINE": "1",
               "HF_HUB_OFFLINE": "1", "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE": "0",
               "VOICE_AGENT_CACHE": str(tmp_path / "va"), "AGENT_HTTP_PORT": "0",
               # Chromium, LiveKit, the engine and the worker share 2 cores: with CPU in the
               # load the worker reports itself full and LiveKit drops the room's job. Load
               # shedding (by the engine's queue) is tested in test_livekit_distribution.py.
               "AGENT_LOAD_CPU": "0"}  # fmt: skip
        worker = _start_worker(env, tmp_path, log)

        def alive() -> str | None:
            if worker.poll() is not None:
                return f"the worker exited with {worker.returncode}:\n{log.read_text()[-3000:]}"
            if web.poll() is not None:
                return f"voice-agent web exited with {web.returncode}:\n{(tmp_path / 'web.log').read_text()}"
            return None

        await _until(lambda: "registered worker" in log.read_text(errors="replace"),
                     "the worker to register", alive=alive)  # fmt: skip
        async with httpx.AsyncClient(base_url=web_url, timeout=60) as http:
            await _web_ready(http, alive)
            await _web_checks(http, server)
        print(f"servers ready {time.monotonic() - t_start:.1f}s after the test started")

        t_browser = time.monotonic()
        # no room from the test: the page offers no room field, the server picks the room
        result = await asyncio.to_thread(_drive_browser, f"{web_url}/", wav, "", screenshot,
                                         tmp_path / "browser.log")  # fmt: skip
        record_property("browser_s", round(time.monotonic() - t_browser, 2))
        if result.get("ok"):  # the turn's line, with LiveKit's e2e_latency (asserted below)
            await _until(lambda: "e2e_latency=" in log.read_text(errors="replace"),
                         "the worker's turn log", alive=alive)  # fmt: skip
    finally:
        if web is not None:
            await asyncio.to_thread(_stop_group, web)
        for room in await _web_rooms(server, result):  # else the job waits out the room's
            await _delete_room(server, room)  # departure timeout
        if worker is not None:
            await asyncio.to_thread(_stop_worker, worker)
        if llm is not None:
            await llm.stop()
        await asyncio.gather(engine_started, return_exceptions=True)  # never stop a half-start
        await asyncio.to_thread(engine.stop)

    print(f"screenshot: {screenshot}")
    print(f"browser result: {json.dumps(result, indent=1)}")
    state = result.get("state") or {}
    context = (f"{json.dumps(result, indent=1)}\n--- worker log ---\n"
               f"{log.read_text(errors='replace')[-3000:]}\n--- browser log ---\n"
               f"{(tmp_path / 'browser.log').read_text(errors='replace')[-2000:]}")  # fmt: skip
    assert result.get("ok"), f"the browser call failed at {result.get('failed')}: {context}"
    assert result["exit_code"] == 0 and screenshot.is_file() and screenshot.stat().st_size > 0
    assert state["room"].startswith(web_client.ROOM_PREFIX) and state["error"] is None, context
    user = " ".join(t["text"].lower() for t in state["transcript"] if t["speaker"] == "user")
    agent = " ".join(t["text"].lower() for t in state["transcript"] if t["speaker"] == "agent")
    assert all(w in user for w in WORDS), context
    assert all(w in agent for w in AGENT_WORDS), context  # the scripted answer, after the tool
    assert any(m.get("role") == "tool" for m in llm.requests[-1]["messages"]), llm.requests
    assert state["mic_heard"] and state["agent_heard"], context
    # voice-to-voice: Silero's ~0.55 s end-of-speech wait at least (how long it takes beyond that
    # is the machine's business). On the page's clock it lies inside the call: from the user's
    # last sound (after the question began) to the agent's first (before the readout was seen).
    assert state["latency_ms"] >= 500, context
    page_steps = result["page_steps_ms"]
    assert 0 <= result["question_start_ms"] <= page_steps["user_transcript"], context
    assert state["latency_ms"] <= page_steps["latency"] - result["question_start_ms"], context
    # the part after the agent's "thinking": none when the page saw no "thinking" after the
    # user's last sound (LiveKit may deliver "thinking" and "speaking" as one update)
    if state["latency_after_turn_ms"] is not None:
        assert 0 <= state["latency_after_turn_ms"] <= state["latency_ms"], context
    # LiveKit's own e2e_latency (the worker's VAD end of speech -> its first audio frame out) is
    # inside the page's reading, which adds the network legs, Opus and the jitter buffer (their
    # length is the machine's business: no upper bound); 150 ms for where Silero and the page's
    # analyser put the end of the question
    e2e = [
        float(x) * 1000
        for x in re.findall(r"e2e_latency=([\d.]+)s", log.read_text(errors="replace"))
    ]
    assert e2e, f"no e2e_latency in the worker's turn log: {context}"
    print(f"the worker's e2e_latency: {e2e[0]:.0f} ms")
    assert e2e[0] - 150 <= state["latency_ms"], (e2e, context)
    assert result.get("left_room"), context
    assert not result["page_errors"], context
    print(f"latency shown: {state['latency_ms']} ms voice-to-voice, "
          f"{state['latency_after_turn_ms']} ms after the agent's end of turn")  # fmt: skip
    record_property("latency_ms", state["latency_ms"])
    record_property("test_s", round(time.monotonic() - t_start, 1))


async def _web_rooms(server, result: dict) -> list[str]:
    """The room the page joined (its state), or, when it did not get that far, every room of
    the web server's naming that the LiveKit server has."""
    if room := (result.get("state") or {}).get("room"):
        return [room]
    lk = api.LiveKitAPI(server.http_url, server.api_key, server.api_secret)
    try:
        rooms = (await asyncio.wait_for(lk.room.list_rooms(api.ListRoomsRequest()), 10)).rooms
    except Exception as e:  # cleanup only: the test's own failure says more
        print(f"could not list the rooms to delete: {e!r}")
        return []
    finally:
        await lk.aclose()
    return [r.name for r in rooms if r.name.startswith(web_client.ROOM_PREFIX)]


async def _web_ready(http: httpx.AsyncClient, alive, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if problem := alive():
            raise AssertionError(problem)
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"voice-agent web did not answer /health within {timeout:.0f}s")


async def _web_checks(http: httpx.AsyncClient, server) -> None:
    """The running `voice-agent web`: its token works for this server, and no response (token,
    page, script) carries the API secret."""
    r = await http.post("/api/token", json={})
    assert r.status_code == 200, r.text
    assert server.api_secret not in r.text
    claims = api.TokenVerifier(server.api_key, server.api_secret).verify(r.json()["token"])
    assert claims.video.room == r.json()["room"] and r.json()["url"] == server.url
    for page in ("/", "/app.js", "/style.css"):
        page_r = await http.get(page)
        assert page_r.status_code == 200 and server.api_secret not in page_r.text, page
    js = await http.get("/livekit-client.umd.js")
    assert js.status_code == 200 and "LivekitClient" in js.text[:2000]
    bad = await http.post("/api/token", json={"room": "x" * 65})
    assert bad.status_code == 400 and "error" in bad.json()
    named = await http.post("/api/token", json={"room": "someone-elses"})  # the default refuses
    assert named.status_code == 403 and "WEB_ALLOW_ROOM_NAMES" in named.json()["error"]["message"]
    assert (await http.get("/api/config")).json() == {"named_rooms": False}  # no room field
