"""Claims of the engine, each checked against the real component: request validation of
unspeakable input, bearer auth on every /v1 route and the body limit (real HTTP on 127.0.0.1),
the quantize-on-load cache when weights change in place, and cloning from reference audio.

mlx runs on pytest's main thread for the in-process checks (safe, see docs/mlx-on-linux.md).
"""

from __future__ import annotations

import hashlib
import io
import os
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import RequestError, SpeechRequest, parse_speech_request
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig
from qwen3_tts_engine.tiny_checkpoints.builder import write_tiny_checkpoint
from qwen3_tts_engine.worker.loading import (
    apply_recipe,
    load,
    load_full_precision,
    quantized_modules,
)
from qwen3_tts_engine.worker.main import _load_ref_audio
from qwen3_tts_engine.worker.synthesis import stream_chunks

API_KEY = "claims-key-456"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 4096

UNSPEAKABLE = ["\u200b\u200c\u2060", "\x00\x07\n\t ", "\ufeff", "\u200b \u200d\u00ad\u2028"]


# -- 1. input of only zero-width / control characters ------------------------------------------


@pytest.mark.parametrize("text", UNSPEAKABLE, ids=ascii)
def test_unspeakable_input_is_a_request_error_on_input(text):
    with pytest.raises(RequestError) as e:
        parse_speech_request({"input": text, "voice": "ryan"})
    assert e.value.status == 400 and e.value.param == "input"
    err = e.value.to_json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "input" and err["message"]


@pytest.mark.parametrize("text", ["Hi.", "\u200bHi\u200b", "42", "\u4f60\u597d", "?!"])
def test_speakable_input_with_invisible_characters_is_accepted(text):
    assert parse_speech_request({"input": text}).input == text


# -- a real engine server on 127.0.0.1 ------------------------------------------------------------


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice"))
    srv = EngineServer(Engine(model, [Handler(model, max_queue=2)]),
                       ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY,
                                    max_body_bytes=MAX_BODY))  # fmt: skip
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client(server):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}",
                                 timeout=httpx.Timeout(120)) as c:  # fmt: skip
        yield c


def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param


@pytest.mark.slow
@pytest.mark.parametrize("text", UNSPEAKABLE, ids=ascii)
async def test_unspeakable_input_over_http_is_400_not_audio(client, text):
    for extra in ({}, {"stream": True, "response_format": "pcm"}):
        r = await client.post("/v1/audio/speech", headers=AUTH,
                              json={"input": text, "voice": "ryan", "max_new_tokens": 4, **extra})  # fmt: skip
        _assert_openai_error(r, 400, "input")
        assert not r.headers.get("content-type", "").startswith("audio/")


# -- 2. bearer auth on every /v1 route; /health open; body limit -----------------------------------


def _v1_routes(server: EngineServer) -> list[tuple[str, str]]:
    """Every (method, path) the app's router has under /v1/, as registered (HEAD included)."""
    routes = []
    for route in server.app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path.startswith("/v1/") and route.method != "*":
            routes.append((route.method, path))
        elif path.startswith("/v1/"):  # a catch-all method: check the usual ones
            routes += [(m, path) for m in ("GET", "POST", "PUT", "DELETE")]
    return sorted(set(routes))


@pytest.mark.slow
async def test_every_v1_route_needs_the_bearer_key(server, client):
    routes = _v1_routes(server)
    # the enumeration itself works: it finds the routes we know of
    assert {("POST", "/v1/audio/speech"), ("GET", "/v1/models"), ("GET", "/v1/engine/status"),
            ("POST", "/v1/engine/variant")} <= set(routes), routes  # fmt: skip
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}x"},
             {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"},
             {"Authorization": "Bearer"}]  # fmt: skip
    for method, path in routes:
        for headers in wrong:
            r = await client.request(
                method, path, headers=headers, json={"input": "Hi.", "variant": "8bit"}
            )
            assert r.status_code == 401, (method, path, headers, r.status_code)
            if method != "HEAD":
                _assert_openai_error(r, 401)
        # with the right key the route answers something other than 401 (a bad body: no synthesis)
        r = await client.request(method, path, headers=AUTH, content=b"{}")
        assert r.status_code != 401, (method, path)


@pytest.mark.slow
async def test_health_is_open(client):
    r = await client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def _body_of_size(size: int) -> bytes:
    """Valid JSON of exactly `size` bytes that the parser rejects on `input` (no synthesis)."""
    head = b'{"input": "", "voice": "ryan"}'
    assert size >= len(head)
    return head + b" " * (size - len(head))


@pytest.mark.slow
async def test_body_limit_is_exact(client):
    at_limit = _body_of_size(MAX_BODY)
    assert len(at_limit) == MAX_BODY
    headers = {**AUTH, "Content-Type": "application/json"}
    r = await client.post("/v1/audio/speech", content=at_limit, headers=headers)
    _assert_openai_error(r, 400, "input")  # read and parsed whole: not 413
    r = await client.post("/v1/audio/speech", content=_body_of_size(MAX_BODY + 1), headers=headers)
    _assert_openai_error(r, 413)
    r = await client.post("/v1/audio/speech", content=_body_of_size(MAX_BODY * 20), headers=headers)
    _assert_openai_error(r, 413)
    assert (await client.get("/ready")).status_code == 200


# -- 3. quantize-on-load cache when the weights change at the same path --------------------------


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _talker_weights(model) -> dict[str, np.ndarray]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return {k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v)
            for k, v in tree_flatten(model.talker.parameters())}  # fmt: skip


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["rewrite", "rewrite-keeping-mtimes"])
def test_quantize_cache_follows_weights_changed_in_place(tmp_path, monkeypatch, keep_mtime):
    monkeypatch.setenv("QWEN3_TTS_CACHE", str(tmp_path / "cache"))  # this test's cache alone
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", variant="custom_voice", seed=0)
    source = resolve(str(ckpt), "8bit")

    first, d1 = load(source, progress=False)
    assert d1["quantized_on_load"] and not d1["from_cache"]
    w1, file1 = _talker_weights(first), _sha(Path(d1["path"]) / "model.safetensors")
    assert set(quantized_modules(first).values()) == {8}

    # nothing changed: the cached quantization is used, and it is the same one
    again, d2 = load(resolve(str(ckpt), "8bit"), progress=False)
    assert d2["from_cache"] and d2["path"] == d1["path"]
    assert _sha(Path(d2["path"]) / "model.safetensors") == file1
    assert _same(_talker_weights(again), w1)

    # other weights at the same path (and the same file names)
    stat = {f.name: f.stat() for f in [ckpt / "config.json", *ckpt.glob("*.safetensors")]}
    weights_before = _sha(ckpt / "model.safetensors")
    write_tiny_checkpoint(ckpt, variant="custom_voice", seed=1)
    assert _sha(ckpt / "model.safetensors") != weights_before
    if keep_mtime:  # as `cp -p` / `rsync -t` from files with the same timestamps leave them
        for name, st in stat.items():
            os.utime(ckpt / name, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (ckpt / "model.safetensors").stat().st_mtime_ns == stat[
            "model.safetensors"
        ].st_mtime_ns

    fresh, d3 = load(resolve(str(ckpt), "8bit"), progress=False)
    assert d3["quantized_on_load"] and not d3["from_cache"]
    assert d3["path"] != d1["path"]
    w3 = _talker_weights(fresh)
    assert not _same(w3, w1)
    # ... and it is the quantization of the new weights
    expected = load_full_precision(ckpt)
    apply_recipe(expected, source.quantize_with)
    assert _same(w3, _talker_weights(expected))


# -- 4. cloning: the reference clip changes the codes ---------------------------------------------


def _wav(samples: np.ndarray, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _clips() -> tuple[bytes, bytes]:
    t = np.arange(int(1.5 * 24000)) / 24000
    low = 0.3 * np.sin(2 * np.pi * 140 * t) + 0.15 * np.sin(2 * np.pi * 280 * t)
    rng = np.random.default_rng(3)
    chirp = 0.3 * np.sin(2 * np.pi * (600 + 900 * t) * t) + 0.05 * rng.standard_normal(t.size)
    return _wav(low), _wav(chirp)


@pytest.fixture(scope="module")
def base_model(tiny_checkpoint):
    model, _ = load(resolve(str(tiny_checkpoint("base"))), progress=False)
    return model


@pytest.mark.slow
@pytest.mark.parametrize(
    "ref_text", [None, "A reference sentence."], ids=["x-vector", "in-context"]
)
def test_reference_audio_steers_the_codes(base_model, ref_text):
    clip_a, clip_b = _clips()

    def codes(clip: bytes) -> np.ndarray:
        req = SpeechRequest(input="Cloned voice.", language="english", seed=5, max_new_tokens=4,
                            ref_text=ref_text)  # fmt: skip
        chunks = list(stream_chunks(base_model, req, ref_audio=_load_ref_audio(clip),
                                    keep_codes=True, decode=False))  # fmt: skip
        return np.concatenate([c.codes for c in chunks])

    a1, a2, b = codes(clip_a), codes(clip_a), codes(clip_b)
    assert a1.shape == (4, 16)
    np.testing.assert_array_equal(a1, a2)  # the same clip twice: the same codes
    assert not np.array_equal(a1, b)  # another clip, same text and seed: other codes
