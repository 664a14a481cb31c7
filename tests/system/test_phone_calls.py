"""Phone calls through a real LiveKit server, as LiveKit's SIP bridge makes them look to the room.

The SIP bridge (github.com/livekit/sip) cannot be built here, so the caller is what the bridge
would put in the room: a participant of kind SIP (an access token of kind "sip") with the
bridge's `sip.*` attributes, publishing speech that went through a G.711 µ-law phone line, and
sending keypad presses as SIP DTMF packets (`publish_dtmf`) through the server. The worker is a
real `voice-agent start`; transfers go to the server's real SIP API, which answers with an error
because no SIP service is connected. The calls run on the two workers of
tests/system/test_livekit_distribution.py (one setup for its checks and these):
`phone_calls_through_a_livekit_server` below.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
from livekit import api, rtc

from tests.system.test_livekit_call import RATE, SILENT_PEAK, WAIT, Caller, _until
from voice_agent.harness.demo import load_turn_audio
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.phone_line import phone_line_wav
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.settings import Settings, parse_dtmf_actions
from voice_agent.telephony import TRANSFER_FAILED, PhoneCaller, digits_as_text

pytestmark = [pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long")]
QUESTION = "What is the capital of France?"  # tiny.en hears it well through a phone line and Opus
NUMBER = "+15550123"
GREETING = "Hello caller {caller_number}, how can I help?"


# -- settings and parsing (no server) ---------------------------------------------------------


def test_dtmf_actions_and_transfer_target_are_checked():
    assert parse_dtmf_actions("0=transfer, 9=hangup,#=hangup") == {
        "0": "transfer",
        "9": "hangup",
        "#": "hangup",
    }
    assert parse_dtmf_actions("") == {}
    for bad, why in (("0=dance", "unknown action"), ("10=hangup", "DIGIT=ACTION"), ("5", "DIGIT=ACTION"),
                     ("1=hangup,1=transfer", "two actions")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_dtmf_actions(bad)
        with pytest.raises(SystemExit, match="DTMF_ACTIONS"):
            Settings.load(env={"DTMF_ACTIONS": bad}, dotenv=None)
    for ok in ("+15550100", "tel:+4930123456", "sip:operator@pbx.example.com"):
        assert Settings.load(env={"TRANSFER_TO": ok}, dotenv=None).transfer_to == ok
    for bad in ("5550100", "+1-555", "operator"):
        with pytest.raises(SystemExit, match="TRANSFER_TO"):
            Settings.load(env={"TRANSFER_TO": bad}, dotenv=None)


def test_a_phone_caller_is_a_sip_participant_with_the_bridges_attributes():
    class P:  # the two fields PhoneCaller reads of an rtc.RemoteParticipant
        def __init__(self, kind, attributes):
            self.identity, self.kind, self.attributes = "sip_+15550123", kind, attributes

    attrs = {"sip.phoneNumber": NUMBER, "sip.callID": "SCL_abc", "sip.trunkPhoneNumber": "+15550999",
             "sip.callStatus": "active"}  # fmt: skip
    caller = PhoneCaller.of(P(rtc.ParticipantKind.PARTICIPANT_KIND_SIP, attrs))
    assert caller == PhoneCaller("sip_+15550123", NUMBER, "SCL_abc", "+15550999", "active")
    assert PhoneCaller.of(P(rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD, attrs)) is None
    assert caller.greeting(GREETING) == "Hello caller 1 5 5 5 0 1 2 3, how can I help?"
    assert PhoneCaller("x").greeting("From {caller_number}.") == "From an unknown number."
    assert NUMBER in caller.instructions()
    assert digits_as_text("12#") == "The caller pressed 1 2 # on the phone keypad."


# -- calls through the real server --------------------------------------------------------------


class PhoneCallerClient(Caller):
    """The test's phone: a SIP-kind participant that speaks phone-line audio and presses keys."""

    def __init__(self, identity: str) -> None:
        super().__init__(identity)
        self.disconnected = asyncio.Event()
        self.room.on("disconnected", lambda *_: self.disconnected.set())

    def token(self, server, room: str) -> str:
        return (api.AccessToken(server.api_key, server.api_secret).with_identity(self.identity)
                .with_kind("sip").with_attributes({"sip.phoneNumber": NUMBER, "sip.callID": f"SCL_{self.identity}",
                                                   "sip.trunkPhoneNumber": "+15550999", "sip.callStatus": "active"})
                .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())  # fmt: skip

    async def press(self, digit: str) -> None:
        code = {"*": 10, "#": 11}.get(digit) or int(digit)
        await self.room.local_participant.publish_dtmf(code=code, digit=digit)

    def said(self, words: str) -> int:
        """How many of the agent's transcripts contain `words`."""
        return sum(words.lower() in t.lower() for sender, attrs, t in self.transcripts
                   if sender != self.identity and attrs.get("lk.transcribed_track_id") != self.mic_sid)  # fmt: skip


async def _active_jobs(port: int) -> int | None:
    try:
        async with httpx.AsyncClient() as c:
            return int(
                (await c.get(f"http://127.0.0.1:{port}/worker", timeout=2))
                .json()
                .get("active_jobs", 0)
            )
    except (httpx.HTTPError, ValueError):
        return None


# What a worker needs for the calls below (tests/system/test_livekit_distribution.py starts its workers
# with it, on the LLM of `phone_llm()`, and runs `phone_calls_through_a_livekit_server` there).
PHONE_ENV = {
    "PHONE_GREETING": GREETING,
    "DTMF_ACTIONS": "0=transfer,9=hangup",
    "TRANSFER_TO": "+15550100",
}


def phone_llm() -> ScriptedChatServer:
    return ScriptedChatServer(tool_rules={"pressed 5": "transfer_call", "pressed 7": "end_call"})


async def phone_calls_through_a_livekit_server(server, llm: ScriptedChatServer, http_ports: list[int],
                                               logs: list[Path], alive, record_property) -> None:  # fmt: skip
    """Phone calls to the workers whose AGENT_HTTP_PORTs are `http_ports` (started with PHONE_ENV,
    `llm` from `phone_llm()`; `alive()` says why a worker is gone, or None). Checks only what the
    workers log from here on."""
    question = load_turn_audio(
        phone_line_wav(speech_wav(QUESTION, sample_rate=RATE), sample_rate=RATE)
    )
    log_start = {log: len(log.read_text(errors="replace")) for log in logs}
    callers: list[PhoneCallerClient] = []

    async def call(name: str) -> PhoneCallerClient:
        caller = PhoneCallerClient(f"sip_{name}_{uuid.uuid4().hex[:4]}")
        callers.append(caller)
        await caller.join(server.url, caller.token(server, f"phone-{name}-{uuid.uuid4().hex[:6]}"))
        await _until(
            lambda: caller.said("1 5 5 5 0 1 2 3") >= 1,
            f"{name}: the greeting with the number",
            alive=alive,
        )
        await _until(lambda: (a := caller.agent()) is not None and a.attributes.get("lk.agent.state") == "listening",
                     f"{name}: the agent to listen after its greeting", alive=alive)  # fmt: skip
        return caller

    async def job_freed(what: str) -> float:
        t0 = time.monotonic()
        while (jobs := [await _active_jobs(p) for p in http_ports]) != [0] * len(http_ports):
            assert time.monotonic() - t0 < WAIT, (
                f"{what}: still {jobs} active jobs after {WAIT:g} s (hang guard)"
            )
            await asyncio.sleep(0.1)
        return time.monotonic() - t0

    def new_log_text() -> str:
        return "".join(log.read_text(errors="replace")[log_start[log] :] for log in logs)

    try:
        # 1. a phone caller asks a question over a phone line and hears the answer
        first = await call("speech")
        await _until(lambda: first.mic_subscribed is not None, "the agent's subscription to the phone's track",
                     alive=alive)  # fmt: skip
        first.say(question)
        await _until(lambda: first.speech_end is not None, "the question to be spoken", alive=alive)
        await _until(lambda: any(t > first.speech_end and p > SILENT_PEAK for t, p in first.agent_frames),
                     "the agent's audio", alive=alive)  # fmt: skip
        v2v = (
            min(t for t, p in first.agent_frames if t > first.speech_end and p > SILENT_PEAK)
            - first.speech_end
        )
        await _until(
            lambda: "capital" in first.user_transcript().lower(),
            "the caller's transcript",
            alive=alive,
        )
        await _until(lambda: first.said("noon") >= 1, "the agent's answer", alive=alive)
        # 2. a digit without an action reaches the LLM as text (and gets a reply)
        await first.press("1")
        await _until(lambda: any(digits_as_text("1") in json.dumps(r["messages"]) for r in llm.requests),
                     "the digit to reach the LLM", alive=alive)  # fmt: skip
        await _until(lambda: first.said("noon") >= 2, "the reply to the digit", alive=alive)
        # 3. the transfer digit: no SIP service, so the transfer fails, is said, and the call goes on
        await first.press("0")
        await _until(
            lambda: first.said(TRANSFER_FAILED) >= 1, "the failed transfer to be said", alive=alive
        )
        # 4. the LLM's transfer_call tool: the same
        await first.press("5")
        await _until(
            lambda: first.said(TRANSFER_FAILED) >= 2,
            "the tool's failed transfer to be said",
            alive=alive,
        )
        assert not first.disconnected.is_set(), "the caller was dropped after a failed transfer"
        # 5. the LLM's end_call tool (LiveKit's EndCallTool): the caller is removed
        await first.press("7")
        await asyncio.wait_for(first.disconnected.wait(), WAIT)
        await job_freed("after end_call")

        # 6. the hang-up digit removes the caller
        second = await call("digit")
        await second.press("9")
        await asyncio.wait_for(second.disconnected.wait(), WAIT)
        await job_freed("after the hang-up digit")

        # 7. the caller hangs up: the session closes and the job ends (not the room's timeout)
        third = await call("hangup")
        t_hangup = time.monotonic()
        await third.room.disconnect()
        await job_freed("after the caller hung up")
        freed = time.monotonic() - t_hangup
    except (AssertionError, TimeoutError) as e:
        raise AssertionError(f"{e!r}\n--- worker logs (this part) ---\n{new_log_text()[-5000:]}\n"
                             f"--- transcripts: {[c.transcripts for c in callers]}") from None  # fmt: skip
    finally:
        for caller in callers:
            await caller.close()

    text = new_log_text()
    print(
        f"voice-to-voice seen by the phone caller: {v2v:.3f}s; job free {freed:.2f}s after the hang-up"
    )
    print(f"transcripts: {first.transcripts}")
    record_property("phone_voice_to_voice_s", round(v2v, 3))
    record_property("phone_job_freed_s", round(freed, 3))
    tools = [m["function"]["name"] for r in llm.requests for m in r.get("tools") or []]
    assert {"end_call", "transfer_call", "get_current_time"} <= set(tools), set(tools)
    assert "phone call SCL_" in text and NUMBER in text  # the worker knew it was a phone call
    assert text.count("transfer of ") >= 2 and "failed" in text
    assert "hanging up on" in text and "the caller pressed 9" in text
    # the third job ended because its session closed when the caller left (its log says why),
    # not at LiveKit's 20 s departure timeout (how soon is printed above: the machine's speed)
    assert "call ended (session closed: participant_disconnected)" in text, text[-3000:]
