"""docs/engine-api.md's limit on `session.start`'s fields holds as written: 64 counting `type`
(the 64th field is taken, the 65th refused with the documented error)."""

from __future__ import annotations

import pytest

from tests.support.speech_socket import client_session, connect, engine_server, receive

API_KEY = "start-fields-key"
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    async with engine_server(str(tiny_checkpoint("custom_voice", eos="text")), 1,
                             api_key=API_KEY) as srv:  # fmt: skip
        yield srv


def _start_with(fields: int) -> dict:
    """A session.start of `fields` fields in all, `type` among them (the rest ignored extras)."""
    body = dict(START)
    body.update({f"extra_{i}": 1 for i in range(fields - len(START))})
    assert len(body) == fields
    return body


@pytest.mark.parametrize("fields, refused", [(64, False), (65, True)])
async def test_session_start_takes_64_fields_counting_type(server, fields, refused):
    async with client_session(server) as session, connect(session, API_KEY) as ws:
        await ws.send_json(_start_with(fields))
        event = await receive(ws)
    too_many = event.get("type") == "error" and "fields; at most 64" in event["error"]["message"]
    assert too_many is refused, event
    if refused:
        assert event["error"]["message"].startswith(f"session.start has {fields} fields"), event
