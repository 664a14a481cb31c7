"""A job's side of call recovery (see keeper.py): heartbeats to the keeper, the conversation
kept in the room's metadata so that an agent dispatched after a crash picks it up, and one agent
per call when a recovery brought two.

The room's metadata is the one place that outlives the agent and that the next agent reads on
joining without another service: `{"voice_agent": {"history": [{"role", "text"}, ...]}}`, the
last HISTORY_TURNS messages, each cut to HISTORY_CHARS (LiveKit caps metadata at 64 KiB).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from collections.abc import Iterable

import aiohttp
import httpx
from livekit import api, rtc
from livekit.agents import JobContext, JobRequest, llm

logger = logging.getLogger("voice_agent")
KEY = "voice_agent"
HISTORY_TURNS = 12
HISTORY_CHARS = 600
HEARTBEAT_S = 1.0


def history_from_metadata(metadata: str | None) -> list[dict]:
    """The conversation a previous agent left in the room's metadata ([] if none or unreadable)."""
    try:
        history = json.loads(metadata or "{}").get(KEY, {}).get("history", [])
    except (ValueError, AttributeError):
        return []
    return [h for h in history if isinstance(h, dict) and h.get("role") in ("user", "assistant")
            and isinstance(h.get("text"), str)]  # fmt: skip


def is_resume_dispatch(job_metadata: str | None) -> bool:
    """The job was dispatched by the keeper to take over a lost call (`{"resume": true, ...}`),
    which may have no history yet (its agent was lost during the first turn)."""
    try:
        data = json.loads(job_metadata or "{}")
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("resume") is True


# This project's voice agents carry their agent name in this attribute, set when a job is
# accepted (`accept_job`): LiveKit drops empty attributes, so `lk.agent.name` is missing for the
# usual unnamed dispatch and cannot tell our agents from a bystander's.
ATTRIBUTE_VOICE_AGENT = "voice_agent.name"


def voice_agent_mark(agent_name: str) -> str:
    return agent_name or "-"


async def accept_job(request: JobRequest) -> None:
    """AgentServer's on_request: accept as LiveKit does, marked as one of this project's agents."""
    await request.accept(attributes={ATTRIBUTE_VOICE_AGENT: voice_agent_mark(request.agent_name)})


# An agent's place in a call: (when it joined, ms since the epoch as the server stamped it;
# its identity). An unknown join time sorts last; the identity breaks ties.
Seat = tuple[int, str]
NOT_JOINED = 2**63


def seat(participant: rtc.Participant) -> Seat:
    joined = participant.joined_at
    return (round(joined.timestamp() * 1000) if joined else NOT_JOINED, participant.identity)


def yields_to(me: Seat, agents: Iterable[Seat]) -> str | None:
    """The identity of the agent `me` leaves the call to, when other agents of this project are
    in its room (None: it stays).

    A call can get two voice agents: after a livekit-server restart the old agent reconnects to
    the room its caller re-created, which LiveKit has dispatched again. Each agent decides alone,
    by one rule both see alike: the one that joined first keeps the call (an agent that rejoins
    after a network cut is the newer one), the smaller identity at the same instant."""
    earlier = sorted(a for a in agents if a < me)
    return earlier[0][1] if earlier else None


def keep_one_agent(ctx: JobContext) -> None:
    """End this job when another agent of this project (the same agent name) in the room keeps
    the call (`yields_to`): checked now, when an agent joins, and after this job reconnects.
    Agents of other names (a note-taker, a transcription bot) are bystanders: they change nothing."""
    if ctx.is_fake_job():  # console mode: no room on a server, one agent
        return
    room = ctx.room
    mark = voice_agent_mark(ctx.job.agent_name)
    left: list[str] = []

    def check(*_args) -> None:
        ours = [seat(p) for p in room.remote_participants.values()
                if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT
                and p.attributes.get(ATTRIBUTE_VOICE_AGENT) == mark]  # fmt: skip
        other = yields_to(seat(room.local_participant), ours)
        if other is not None and not left:
            left.append(other)
            logger.warning("agent %s joined this call first and keeps it: this job ends", other)
            ctx.shutdown(reason=f"another agent ({other}) serves this call")

    room.on("participant_connected", check)
    room.on("reconnected", check)
    check()


def metadata_with_history(metadata: str | None, history: list[dict]) -> str:
    """The room's metadata with our history replaced (other keys are kept)."""
    try:
        data = json.loads(metadata or "{}")
        data = data if isinstance(data, dict) else {"metadata": data}
    except ValueError:
        data = {"metadata": metadata}
    data[KEY] = {"history": [{"role": h["role"], "text": h["text"][:HISTORY_CHARS]}
                             for h in history[-HISTORY_TURNS:]]}  # fmt: skip
    return json.dumps(data, ensure_ascii=False)


def chat_context(history: list[dict]) -> llm.ChatContext:
    ctx = llm.ChatContext.empty()
    for h in history:
        ctx.add_message(role=h["role"], content=h["text"])
    return ctx


class CallRecord:
    """Keeps the session's conversation in the room's metadata, and (with a keeper) sends the
    job's heartbeats. `resumed`: the previous agent's history, when this job continues a call."""

    def __init__(self, ctx: JobContext, session, *, keeper_url: str | None) -> None:
        self.ctx, self.session, self.keeper_url = ctx, session, keeper_url
        self.resumed = history_from_metadata(ctx.room.metadata)
        self.history = list(self.resumed)
        self._write: asyncio.Task | None = None
        self._dirty = False
        self._beats: asyncio.Task | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    def start(self) -> CallRecord:
        self.session.on("conversation_item_added", self._on_item)
        if self.keeper_url:
            self._beats = asyncio.create_task(self._heartbeats(), name="keeper-heartbeat")
        return self

    async def aclose(self) -> None:
        """The job ends normally: the keeper is told (so it does not recover the call), on the
        heartbeat socket before it closes (or in a single beat when there is no socket)."""
        if self._beats is not None:
            said = False
            if self._ws is not None and not self._ws.closed:
                try:
                    await asyncio.wait_for(self._ws.send_json({"state": "ended"}), 2)
                    said = True
                except Exception as e:  # the socket broke: the single beat below says it
                    logger.debug("goodbye on the heartbeat socket: %s", e)
            self._beats.cancel()
            await asyncio.gather(self._beats, return_exceptions=True)
            if not said:
                await self._beat(state="ended")
        if self._write is not None:
            await asyncio.gather(self._write, return_exceptions=True)

    def _on_item(self, ev) -> None:
        item = ev.item
        text = getattr(item, "text_content", None)
        if (
            getattr(item, "type", None) != "message"
            or item.role not in ("user", "assistant")
            or not text
        ):
            return
        self.history.append({"role": item.role, "text": text})
        self._dirty = True
        if self._write is None or self._write.done():
            self._write = asyncio.create_task(self._store())

    async def _store(self) -> None:
        while self._dirty:  # one writer; the latest history wins
            self._dirty = False
            metadata = metadata_with_history(self.ctx.room.metadata, self.history)
            try:
                await self.ctx.api.room.update_room_metadata(
                    api.UpdateRoomMetadataRequest(room=self.ctx.room.name, metadata=metadata)
                )
            except Exception as e:  # the call goes on without a record
                logger.warning("could not store the conversation in the room's metadata: %s", e)

    def _token(self) -> str:
        """A short-lived LiveKit token naming this room and agent: the keeper's credential (the
        worker exports LIVEKIT_API_KEY / LIVEKIT_API_SECRET to its jobs)."""
        identity = self.ctx.room.local_participant.identity
        return (api.AccessToken().with_identity(identity).with_ttl(datetime.timedelta(minutes=1))
                .with_grants(api.VideoGrants(room=self.ctx.room.name)).to_jwt())  # fmt: skip

    async def _beat(self, state: str = "alive", client: httpx.AsyncClient | None = None) -> None:
        body = {"room": self.ctx.room.name, "identity": self.ctx.room.local_participant.identity,
                "state": state}  # fmt: skip
        headers = {"Authorization": f"Bearer {self._token()}"}
        url = f"{self.keeper_url.rstrip('/')}/v1/heartbeat"
        try:
            if client is None:
                async with httpx.AsyncClient(timeout=2) as c:
                    await c.post(url, json=body, headers=headers)
            else:
                await client.post(url, json=body, headers=headers)
        except httpx.HTTPError as e:
            logger.debug("heartbeat to %s: %s", url, e)

    async def _heartbeats(self) -> None:
        """Beats on one WebSocket, so that the keeper notices at once when this process dies (the
        kernel closes the socket); while the socket cannot be opened, single beats are posted."""
        url = f"{self.keeper_url.rstrip('/')}/v1/heartbeat/ws".replace("http", "ws", 1)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=2)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            httpx.AsyncClient(timeout=2) as client,
        ):
            while True:
                try:
                    async with http.ws_connect(url, headers={"Authorization": f"Bearer {self._token()}"},
                                               heartbeat=None) as ws:  # fmt: skip
                        self._ws = ws
                        while not ws.closed:
                            await ws.send_json({"state": "alive"})
                            await asyncio.sleep(HEARTBEAT_S)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # refused, reset, closed by a restarting keeper
                    logger.debug("heartbeat socket to %s: %s", url, e)
                finally:
                    self._ws = None
                await self._beat(client=client)
                await asyncio.sleep(HEARTBEAT_S)
