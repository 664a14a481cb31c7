"""`voice-agent web`'s token endpoint: nobody gets a token for a call that is not theirs.

By default the server picks a new, unguessable room per visit and refuses a named one (403).
With WEB_ALLOW_ROOM_NAMES a named room is granted only while no person is in it (409), asked of
a real livekit-server (tests/support/livekit_server.py) where people and agents join with LiveKit's rtc
SDK; no answer from LiveKit is 503. Tokens per client are rate-limited (429 + Retry-After), on a
clock the tests move by hand, so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import contextlib
import json
import uuid

import jwt
import pytest
from aiohttp.test_utils import TestClient, TestServer
from livekit import api, rtc

from tests.support.engine_process import free_port
from tests.support.livekit_server import livekit_server  # noqa: F401 (the fixture)
from tests.system.test_livekit_call import _delete_room
from voice_agent import web_client
from voice_agent.cli import build_parser
from voice_agent.settings import WebSettings, from_args

pytestmark = pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long")  # devkey/secret
SECRET = "fake-api-secret-for-the-web-tests-0123456789"  # long enough for HMAC-SHA256


class Clock:
    """A clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _settings(server=None, **kw) -> WebSettings:
    """Settings for `server` (a LiveKitServer), or for a LiveKit URL where nothing listens."""
    if server is None:
        base = dict(livekit_url=f"ws://127.0.0.1:{free_port()}", livekit_api_key="webtestkey",
                    livekit_api_secret=SECRET)  # fmt: skip
    else:
        base = dict(livekit_url=server.url, livekit_api_key=server.api_key,
                    livekit_api_secret=server.api_secret)  # fmt: skip
    return WebSettings(**{**base, **kw})


@contextlib.asynccontextmanager
async def _client(settings: WebSettings, clock=None):
    app = web_client.create_app(settings, **({"clock": clock} if clock else {}))
    async with TestClient(TestServer(app)) as client:
        yield client


async def _token(client: TestClient, body=None):
    """(status, JSON body, response) of one POST /api/token."""
    r = await client.post("/api/token", json=body if body is not None else {})
    return r.status, json.loads(await r.text()), r


def _claims(settings: WebSettings, token: str) -> api.Claims:
    return api.TokenVerifier(settings.livekit_api_key, settings.livekit_api_secret).verify(token)


def _room() -> str:
    return f"named-{uuid.uuid4().hex[:10]}"


@contextlib.asynccontextmanager
async def _in_room(server, room: str, kind: str = "standard"):
    """A participant of `kind` (standard: a person's browser, sip: a phone, agent) in `room`,
    joined with a token of the test's own; the room is deleted afterwards."""
    token = (api.AccessToken(server.api_key, server.api_secret)
             .with_identity(f"{kind}-{uuid.uuid4().hex[:6]}").with_kind(kind)
             .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())  # fmt: skip
    participant = rtc.Room()
    await participant.connect(server.url, token)
    try:
        yield participant
    finally:
        await participant.disconnect()
        await _delete_room(server, room)


# --- default: the server picks the room -----------------------------------------------------------


async def test_by_default_the_server_picks_a_new_room_per_visit():
    settings = _settings()  # nothing listens at its LiveKit URL: this mode never asks LiveKit
    async with _client(settings) as client:
        assert await (await client.get("/api/config")).json() == {"named_rooms": False}
        rooms = set()
        for _ in range(2):
            status, body, _r = await _token(client)
            assert status == 200, body
            claims = _claims(settings, body["token"])
            assert claims.video.room == body["room"] and claims.video.room_join
            assert claims.identity == body["identity"]
            assert not claims.video.room_admin and not claims.video.room_list
            assert body["room"].startswith("web-") and len(body["room"]) >= len("web-") + 16
            rooms.add(body["room"])
            times = jwt.decode(body["token"], options={"verify_signature": False})
            assert times["exp"] - times["nbf"] == settings.web_token_ttl  # short-lived
        assert len(rooms) == 2


@pytest.mark.parametrize("body", [{"room": "my-room"}, {"room": "web-0123456789abcdef0123"}])
async def test_by_default_a_named_room_is_refused(body):
    async with _client(_settings()) as client:
        status, answer, r = await _token(client, body)
        assert status == 403 and answer["error"]["code"] == 403, answer
        assert "WEB_ALLOW_ROOM_NAMES" in answer["error"]["message"]
        assert "token" not in answer and r.headers["Cache-Control"] == "no-store"


# --- named rooms: only while nobody is in them ------------------------------------------------------


async def test_named_rooms_refuse_a_room_with_a_person_in_it(livekit_server):  # noqa: F811
    settings = _settings(livekit_server, web_allow_room_names=True)
    empty, occupied = _room(), _room()
    async with _client(settings) as client, _in_room(livekit_server, occupied):
        assert await (await client.get("/api/config")).json() == {"named_rooms": True}
        status, body, _r = await _token(client, {"room": empty})  # does not exist yet
        assert status == 200, body
        assert body["room"] == _claims(settings, body["token"]).video.room == empty

        status, body, _r = await _token(client, {"room": occupied})
        assert status == 409 and body["error"]["code"] == 409, body
        assert occupied in body["error"]["message"]
        assert "WEB_ALLOW_OCCUPIED_ROOMS" in body["error"]["message"] and "token" not in body

        status, body, _r = await _token(client)  # no name: still a new room of the server's
        assert status == 200 and body["room"].startswith("web-"), body


@pytest.mark.parametrize("kind, status", [("sip", 409), ("agent", 200)])
async def test_a_phone_counts_as_a_person_an_agent_does_not(livekit_server, kind, status):  # noqa: F811
    settings = _settings(livekit_server, web_allow_room_names=True)
    room = _room()
    async with _client(settings) as client, _in_room(livekit_server, room, kind):
        got, body, _r = await _token(client, {"room": room})
        assert got == status, body


async def test_occupied_rooms_can_be_allowed(livekit_server):  # noqa: F811
    settings = _settings(livekit_server, web_allow_room_names=True, web_allow_occupied_rooms=True)
    room = _room()
    async with _client(settings) as client, _in_room(livekit_server, room):
        status, body, _r = await _token(client, {"room": room})
        assert status == 200, body
        assert _claims(settings, body["token"]).video.room == room


async def test_no_answer_from_livekit_is_503_never_a_token():
    settings = _settings(web_allow_room_names=True)  # nothing listens at its LiveKit URL
    async with _client(settings) as client:
        status, body, _r = await _token(client, {"room": _room()})
        assert status == 503 and body["error"]["code"] == 503, body
        assert "LiveKit server" in body["error"]["message"] and "token" not in body
        status, body, _r = await _token(client)  # a room of the server's needs no check
        assert status == 200, body
        app = client.server.app
    assert app[web_client.LIVEKIT_API]._session.closed  # closed with the app


async def test_a_livekit_server_that_refuses_the_key_is_503_too(livekit_server):  # noqa: F811
    settings = _settings(livekit_server, web_allow_room_names=True, livekit_api_secret=SECRET)
    async with _client(settings) as client:
        status, body, _r = await _token(client, {"room": _room()})
        assert status == 503, body


# --- rate limit --------------------------------------------------------------------------------------


async def test_too_many_tokens_from_one_client_get_429_with_retry_after():
    clock = Clock()
    async with _client(_settings(web_token_rate=3), clock) as client:
        assert (await _token(client))[0] == 200  # at 0 s
        clock.now += 10
        assert (await _token(client))[0] == 200  # at 10 s
        clock.now += 10
        assert (await _token(client, {"room": "mine"}))[0] == 403  # at 20 s: refused ones count
        status, body, r = await _token(client)
        assert status == 429 and body["error"]["code"] == 429, body
        assert "WEB_TOKEN_RATE" in body["error"]["message"] and "token" not in body
        assert r.headers["Retry-After"] == "40"  # the first request leaves the window at 60 s
        clock.now += 39.5
        assert (await _token(client))[2].headers["Retry-After"] == "1"  # never 0
        clock.now += 0.5
        assert (await _token(client))[0] == 200  # at 60 s
        status, _body, r = await _token(client)
        assert status == 429 and r.headers["Retry-After"] == "10"  # the second leaves at 70 s


async def test_rate_zero_is_no_limit():
    async with _client(_settings(web_token_rate=0), Clock()) as client:
        for _ in range(30):
            assert (await _token(client))[0] == 200


def test_the_limiter_counts_per_client_and_forgets_stale_ones():
    clock = Clock()
    limiter = web_client.RateLimiter(2, window=60, max_clients=3, clock=clock)
    assert [limiter.hit("a"), limiter.hit("a"), limiter.hit("b")] == [0, 0, 0]
    assert limiter.hit("a") == 60 and len(limiter) == 2
    clock.now += 59.5
    assert limiter.hit("a") == 1  # never 0 while refused
    assert limiter.hit("c") == 0 and limiter.hit("d") == 0  # four clients, at most three kept
    assert len(limiter) == 3
    clock.now += 0.5  # b's request is a minute old: forgotten (a was, as the oldest of four)
    assert limiter.hit("a") == 0 and len(limiter) == 3  # c, d, a
    clock.now += 60
    assert limiter.hit("e") == 0 and len(limiter) == 1
    for n in range(1000):
        limiter.hit(f"client-{n}")
    assert len(limiter) == 3


# --- settings -------------------------------------------------------------------------------------


def test_the_defaults_are_the_safe_ones():
    s = WebSettings()
    assert (s.web_allow_room_names, s.web_allow_occupied_rooms, s.web_token_rate) == (
        False,
        False,
        10,
    )


def test_flags_set_the_room_settings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in ("WEB_ALLOW_ROOM_NAMES", "WEB_ALLOW_OCCUPIED_ROOMS", "WEB_TOKEN_RATE"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["web", "--web-allow-room-names", "--web-token-rate", "5"])
    s = from_args(args, WebSettings)
    assert (s.web_allow_room_names, s.web_allow_occupied_rooms, s.web_token_rate) == (
        True,
        False,
        5,
    )


@pytest.mark.parametrize("env, words", [
    ({"WEB_TOKEN_RATE": "-1"}, "WEB_TOKEN_RATE (set in the environment): must be >= 0"),
    ({"WEB_TOKEN_RATE": "ten"}, "WEB_TOKEN_RATE='ten' is not a valid int"),
    ({"WEB_ALLOW_ROOM_NAMES": "maybe"}, "WEB_ALLOW_ROOM_NAMES='maybe' is not a valid bool"),
    ({"WEB_ALLOW_OCCUPIED_ROOMS": "2"}, "WEB_ALLOW_OCCUPIED_ROOMS='2' is not a valid bool"),
])  # fmt: skip
def test_bad_settings_are_refused(env, words):
    with pytest.raises(SystemExit) as e:
        WebSettings.load(env=env, dotenv=None)
    assert words in str(e.value)


def test_a_bad_rate_flag_or_object_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["web", "--web-token-rate", "-3"])
    assert "argument --web-token-rate: must be >= 0, got -3" in capsys.readouterr().err
    with pytest.raises(web_client.ConfigError, match="WEB_TOKEN_RATE: must be >= 0"):
        web_client.create_app(_settings(web_token_rate=-1))
