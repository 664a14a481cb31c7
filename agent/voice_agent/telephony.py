"""Phone calls: callers that come through LiveKit's SIP bridge, their keypad (DTMF), call control.

LiveKit's SIP bridge joins a phone caller to the room as a participant of kind SIP whose
attributes name the call (`sip.callID`, `sip.phoneNumber`, `sip.trunkPhoneNumber`,
`sip.callStatus`), and forwards keypad presses as SIP DTMF packets. `PhoneCall` is what the agent
does for such a caller: greet, run the configured DTMF actions (transfer, hang up) or hand the
digits to the LLM as text, and transfer or end the call through LiveKit's server API.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from livekit import api, rtc
from livekit.agents import JobContext, RunContext, function_tool
from livekit.agents.llm import ToolResult

logger = logging.getLogger("voice_agent")

ATTR_CALL_ID = "sip.callID"
ATTR_PHONE_NUMBER = "sip.phoneNumber"
ATTR_TRUNK_PHONE_NUMBER = "sip.trunkPhoneNumber"
ATTR_CALL_STATUS = "sip.callStatus"
DIGIT_GAP_S = 1.0  # digits pressed closer together than this reach the LLM as one input
TRANSFER_TIMEOUT_S = 30.0
# The rate the TTS engine is asked for (and the agent's audio track is published at) on a phone
# call: wideband telephony (G.722, Opus at 16 kHz) carries up to 7-8 kHz, and narrowband G.711
# (8 kHz) is made from it by LiveKit's SIP bridge; 24 kHz would only make audio the phone drops
# (docs/telephony.md "Phone-rate audio").
PHONE_SAMPLE_RATE = 16000
TRANSFER_FAILED = "Sorry, I could not transfer your call. I am still here with you."
NO_TRANSFER = "Sorry, I cannot transfer calls. I am still here with you."


@dataclass(frozen=True)
class PhoneCaller:
    """A participant that is a phone call (kind SIP), with what the SIP bridge says about it."""

    identity: str
    phone_number: str = ""
    call_id: str = ""
    trunk_phone_number: str = ""
    call_status: str = ""

    @classmethod
    def of(cls, participant: rtc.RemoteParticipant) -> PhoneCaller | None:
        if participant.kind != rtc.ParticipantKind.PARTICIPANT_KIND_SIP:
            return None
        a = participant.attributes or {}
        return cls(participant.identity, a.get(ATTR_PHONE_NUMBER, ""), a.get(ATTR_CALL_ID, ""),
                   a.get(ATTR_TRUNK_PHONE_NUMBER, ""), a.get(ATTR_CALL_STATUS, ""))  # fmt: skip

    def greeting(self, template: str) -> str:
        """The greeting with `{caller_number}` filled in (digits spoken one by one)."""
        number = (
            " ".join(self.phone_number.lstrip("+")) if self.phone_number else "an unknown number"
        )
        return template.replace("{caller_number}", number)

    def instructions(self) -> str:
        """What the LLM is told about the call (added to the system prompt)."""
        who = f" from {self.phone_number}" if self.phone_number else ""
        return (f"You are on a phone call{who}. The caller hears you through a telephone: keep "
                "answers short. When the caller presses keys on the keypad you are told "
                "'The caller pressed ...'.")  # fmt: skip


def digits_as_text(digits: str) -> str:
    return f"The caller pressed {' '.join(digits)} on the phone keypad."


class PhoneCall:
    """One phone call's keypad and call control (transfer, hang-up) for its AgentSession."""

    def __init__(self, ctx: JobContext, session, caller: PhoneCaller, *,
                 actions: dict[str, str], transfer_to: str | None, digit_gap: float = DIGIT_GAP_S) -> None:  # fmt: skip
        self.ctx, self.session, self.caller = ctx, session, caller
        self.actions, self.transfer_to, self.digit_gap = actions, transfer_to, digit_gap
        self.digits: list[str] = []  # every digit received, in order (for logs and tests)
        self._pending: list[str] = []
        self._flush: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> PhoneCall:
        self.ctx.room.on("sip_dtmf_received", self._on_dtmf)
        return self

    def close(self) -> None:
        self.ctx.room.off("sip_dtmf_received", self._on_dtmf)
        if self._flush is not None:
            self._flush.cancel()
        for task in self._tasks:
            task.cancel()

    def tools(self) -> list:
        """LLM tools for this call: `transfer_call` (when TRANSFER_TO is set). `end_call` is
        LiveKit's own EndCallTool (added by the caller of this)."""
        return [self._transfer_tool()] if self.transfer_to else []

    # -- DTMF ---------------------------------------------------------------------------------

    def _on_dtmf(self, ev: rtc.SipDTMF) -> None:
        if ev.participant is None or ev.participant.identity != self.caller.identity:
            return
        digit = ev.digit or _digit_of_code(ev.code)
        self.digits.append(digit)
        logger.info("DTMF %r from %s", digit, self.caller.identity)
        if (action := self.actions.get(digit)) is not None:
            self._send_digits()  # digits typed before the action reach the LLM first
            self._spawn(
                self.hang_up(f"the caller pressed {digit}")
                if action == "hangup"
                else self.transfer()
            )
            return
        self._pending.append(digit)
        if self._flush is not None:
            self._flush.cancel()
        self._flush = asyncio.get_running_loop().call_later(self.digit_gap, self._send_digits)

    def _send_digits(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self._pending:
            return
        text, self._pending = digits_as_text("".join(self._pending)), []
        self.session.interrupt()
        self.session.generate_reply(user_input=text)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- call control -------------------------------------------------------------------------

    async def transfer(self) -> str | None:
        """Cold-transfer the caller to TRANSFER_TO; on failure the agent says so and stays on the
        line. Returns what went wrong, or None."""
        if not self.transfer_to:
            self.session.say(NO_TRANSFER)
            return "no transfer number is configured (TRANSFER_TO)"
        logger.info("transferring %s to %s", self.caller.identity, self.transfer_to)
        try:
            await asyncio.wait_for(self.ctx.transfer_sip_participant(self.caller.identity, self.transfer_to),
                                   TRANSFER_TIMEOUT_S)  # fmt: skip
        except Exception as e:  # TwirpError (no SIP service, trunk refused), timeout
            error = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
            logger.warning(
                "transfer of %s to %s failed: %s", self.caller.identity, self.transfer_to, error
            )
            self.session.say(TRANSFER_FAILED)
            return error
        return None

    async def hang_up(self, reason: str) -> None:
        """End the call: the room is deleted (the SIP bridge hangs up), then the job ends."""
        logger.info("hanging up on %s: %s", self.caller.identity, reason)
        try:
            await self.ctx.api.room.delete_room(api.DeleteRoomRequest(room=self.ctx.room.name))
        except Exception as e:  # already gone, server unreachable: the job ends all the same
            logger.warning("deleting room %s: %s", self.ctx.room.name, e)
        self.ctx.shutdown(reason=f"hang-up: {reason}")

    def _transfer_tool(self):
        async def transfer_call(context: RunContext) -> ToolResult:
            error = await self.transfer()
            if error is None:
                return ToolResult(output="The call was transferred.", reply_required=False)
            return ToolResult(output=f"The transfer failed ({error}). The caller was told and is "
                              "still on the line.", reply_required=False)  # fmt: skip

        return function_tool(
            transfer_call, name="transfer_call",
            description="Transfer the caller to a person (a human operator). Call it when the "
                        "caller asks for a person, an operator or a transfer.")  # fmt: skip


def _digit_of_code(code: int) -> str:
    """RFC 4733 event codes: 0-9, 10 = *, 11 = #."""
    return "*" if code == 10 else "#" if code == 11 else str(code)
