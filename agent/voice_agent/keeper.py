"""`voice-agent keeper`: calls get their agent back.

LiveKit dispatches a room to a worker once. When that worker is killed or its host is lost, the
agent participant lingers until the server's ping timeout (about 15-20 s) and the room is never
dispatched again; a room created while every worker reports full never gets an agent either.
The keeper closes both gaps with LiveKit's own mechanisms:

- every job sends a heartbeat about once a second on a WebSocket (`GET /v1/heartbeat/ws`, a
  LiveKit access token naming the room and agent as the credential; `POST /v1/heartbeat` takes
  single beats). A job whose socket closes without its goodbye ("ended") died: its process was
  killed, so the kernel closed the socket, and the keeper acts at once. A job whose heartbeats
  stop for `heartbeat_timeout` (a host that is cut off) is lost too. Either way its agent
  participant is removed (RoomService.RemoveParticipant) and, if a caller is still in the room,
  a new agent is dispatched explicitly (AgentDispatchService.CreateDispatch) to a surviving worker;
- server webhooks (`POST /webhook`, signed by LiveKit): `room_started` puts a room on watch (a room
  that has a caller and no agent after `dispatch_wait` gets an explicit dispatch, retried until an
  agent comes), `participant_left` of an agent while a caller stays triggers a dispatch (after LEFT_GRACE),
  `room_finished` forgets the room. Every SWEEP_S the server's room list adds the rooms with
  participants that no webhook told of. Decisions wait LEFT_GRACE after an agent leaves: a job that
  ends on purpose leaves before its last heartbeat ("ended") and before its room is deleted.

The new agent picks the conversation up from the room's metadata, where each job keeps the last
turns (`agent/voice_agent/recovery.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web
from livekit import api
from livekit.protocol.models import ParticipantInfo

from voice_agent.recovery import ATTRIBUTE_VOICE_AGENT, voice_agent_mark

logger = logging.getLogger("voice_agent.keeper")
CALLER_KINDS = (ParticipantInfo.Kind.STANDARD, ParticipantInfo.Kind.SIP)
MAX_BODY = 64 * 1024
# After an agent leaves, seconds before the keeper acts: a job that ends on purpose (end_call
# deletes the room; a hang-up) leaves the room before its last heartbeat says "ended" and before
# the room is gone, and a dispatch in that moment would send a new agent into a closing call.
LEFT_GRACE = 2.0
FIRST_BEAT_GRACE = 10.0  # seconds a joined agent has before its heartbeats count (see below)
SWEEP_S = 10.0  # seconds between looks at the server's room list (rooms no webhook told of)
JOIN_WAIT = 60.0  # seconds an assigned dispatch has for its agent to join (a job process may
# have to start and load its models first, slowly on a busy host)


@dataclass
class Recovery:
    room: str
    reason: str
    lost_agent: str | None
    at: float  # time.monotonic() of the decision
    dispatch_id: str | None = None
    error: str | None = None


@dataclass
class RoomWatch:
    started: float
    agents: dict[str, float] = field(default_factory=dict)  # identity -> last heartbeat
    ended: set[str] = field(default_factory=set)  # agents that said goodbye (job ended normally)
    left: dict[str, float] = field(default_factory=dict)  # agents gone without goodbye -> when
    quiet_until: float = 0.0  # no "no agent" dispatch before this (an agent just left)
    last_dispatch: float | None = None
    dispatch_id: str | None = None  # ours, not yet answered by an agent joining


class CallKeeper:
    def __init__(self, url: str, api_key: str, api_secret: str, *, agent_name: str = "",
                 heartbeat_timeout: float = 3.0, dispatch_wait: float = 5.0, tick: float = 0.5,
                 sweep: float = SWEEP_S) -> None:  # fmt: skip
        self.url, self.api_key, self.api_secret = url, api_key, api_secret
        self.agent_name = agent_name
        self._mark = voice_agent_mark(agent_name)  # what our agents' ATTRIBUTE_VOICE_AGENT says
        self.heartbeat_timeout, self.dispatch_wait, self.tick_s = (
            heartbeat_timeout,
            dispatch_wait,
            tick,
        )
        self.sweep_s = sweep
        self.rooms: dict[str, RoomWatch] = {}
        self.recoveries: list[Recovery] = []
        self._verifier = api.TokenVerifier(api_key, api_secret)
        self._webhooks = api.WebhookReceiver(self._verifier)
        self._lk: api.LiveKitAPI | None = None
        self._task: asyncio.Task | None = None
        self._busy: set[str] = set()  # rooms with a decision in flight
        self.decisions: deque[tuple[str, str]] = deque(maxlen=200)  # (room, reason), oldest first
        self.sockets: set[tuple[str, str]] = set()  # (room, agent) of each open heartbeat socket
        self._stopping = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._lk = api.LiveKitAPI(self.url.replace("ws", "http", 1), self.api_key, self.api_secret)
        self._task = asyncio.create_task(self._loop(), name="keeper-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._lk is not None:
            await self._lk.aclose()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/webhook", self._on_webhook)
        app.router.add_post("/v1/heartbeat", self._on_heartbeat)
        app.router.add_get("/v1/heartbeat/ws", self._on_heartbeat_socket)
        app.router.add_get("/v1/status", self._on_status)
        app.router.add_get("/", self._on_root)

        async def started(_app) -> None:
            await self.start()

        async def stopped(_app) -> None:
            await self.stop()

        async def stopping(_app) -> None:  # our own shutdown closes the heartbeat sockets
            self._stopping = True

        app.on_shutdown.append(stopping)

        app.on_startup.append(started)
        app.on_cleanup.append(stopped)
        return app

    # -- inputs -------------------------------------------------------------------------------

    async def _on_root(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _on_webhook(self, request: web.Request) -> web.Response:
        body = await request.text()
        try:
            event = self._webhooks.receive(body, request.headers.get("Authorization", ""))
        except Exception as e:  # bad signature, body hash, JSON
            return web.json_response({"error": f"not a LiveKit webhook: {e}"}, status=401)
        now = time.monotonic()
        room = event.room.name
        if event.event == "room_started":
            # a new room, or the same name again (a restarted server, a caller calling back): a
            # fresh watch, keeping only the agents whose jobs beat (they may rejoin it)
            old = self.rooms.get(room)
            self.rooms[room] = RoomWatch(started=now, agents=dict(old.agents) if old else {})
        elif event.event == "room_finished":
            self.rooms.pop(room, None)
        elif event.event == "participant_joined" and self._ours(event.participant):
            watch = self.rooms.setdefault(room, RoomWatch(started=now))
            # its job beats once its session has started, seconds after the join on a busy host:
            # the heartbeat timeout runs from FIRST_BEAT_GRACE after the join
            watch.agents.setdefault(event.participant.identity, now + FIRST_BEAT_GRACE)
            watch.dispatch_id = None
        elif event.event == "participant_left" and self._ours(event.participant):
            watch = self.rooms.get(room)
            identity = event.participant.identity
            if watch is not None:
                watch.quiet_until = now + LEFT_GRACE
                if identity in watch.agents and identity not in watch.ended:
                    watch.left[identity] = now  # a crash or a removal, unless "ended" comes soon
                watch.agents.pop(identity, None)
        return web.Response(text="ok")

    def _ours(self, participant: ParticipantInfo) -> bool:
        """One of this project's voice agents (the attribute its jobs are accepted with,
        `recovery.accept_job`): an agent of another name (a note-taker, a transcription bot) is
        a bystander, neither watched for heartbeats nor counted as the call's agent."""
        return (participant.kind == ParticipantInfo.Kind.AGENT
                and participant.attributes.get(ATTRIBUTE_VOICE_AGENT) == self._mark)  # fmt: skip

    async def _on_heartbeat(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        try:
            claims = self._verifier.verify(token)
            body = await request.json()
            room, identity = str(body["room"]), str(body["identity"])
        except Exception as e:
            return web.json_response(
                {"error": f"bad heartbeat: {e}"}, status=401 if not token else 400
            )
        if claims.video is None or claims.video.room != room or claims.identity != identity:
            return web.json_response(
                {"error": "the token is not for this room and agent"}, status=403
            )
        self._beat(room, identity, body.get("state"))
        return web.Response(text="ok")

    async def _on_heartbeat_socket(self, request: web.Request) -> web.StreamResponse:
        """Heartbeats on one WebSocket (`{"state": "alive"}` about once a second, `"ended"` as
        the goodbye). The token names the room and the agent. A socket that closes without the
        goodbye is a job that died (its process was killed, its host stopped): its call is
        recovered at once instead of after `heartbeat_timeout`."""
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        try:
            claims = self._verifier.verify(token)
        except Exception as e:
            return web.json_response({"error": f"bad heartbeat token: {e}"}, status=401)
        room, identity = claims.video.room if claims.video else "", claims.identity
        if not room or not identity:
            return web.json_response({"error": "the token names no room or agent"}, status=403)
        ws = web.WebSocketResponse(heartbeat=None, max_msg_size=MAX_BODY)
        await ws.prepare(request)
        state = None
        self.sockets.add((room, identity))
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    break
                try:
                    state = json.loads(msg.data).get("state", "alive")
                except (ValueError, AttributeError):
                    await ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"not a heartbeat")
                    return ws
                self._beat(room, identity, state)
                if state == "ended":
                    break
        finally:
            self.sockets.discard((room, identity))
        if state != "ended" and not self._stopping:
            watch = self.rooms.get(room)
            # with a decision about the room in flight, the agent stays on watch: its heartbeat
            # timeout decides it after that one (a lost agent is never dropped undecided)
            if (
                watch is not None
                and identity in watch.agents
                and self._decide(
                    room,
                    f"no heartbeat from {identity}: its connection closed without a goodbye",
                    identity,
                )
            ):
                del watch.agents[identity]
        return ws

    def _beat(self, room: str, identity: str, state: str | None) -> None:
        now = time.monotonic()
        watch = self.rooms.setdefault(room, RoomWatch(started=now))
        if state == "ended":
            watch.ended.add(identity)
            watch.agents.pop(identity, None)
            watch.left.pop(identity, None)
            watch.quiet_until = now + LEFT_GRACE
        else:
            # a beat within FIRST_BEAT_GRACE of the join keeps the grace: a job's first seconds
            # (its session starting on a busy host) may stall its beats for seconds (seen: 3.5 s
            # between its first two beats, and a healthy agent removed as lost)
            watch.agents[identity] = max(now, watch.agents.get(identity, now))
            watch.dispatch_id = None

    async def _on_status(self, _request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response({
            "rooms": {name: {"agents": {a: round(now - t, 2) for a, t in w.agents.items()},
                             "age_s": round(now - w.started, 2)} for name, w in self.rooms.items()},
            "heartbeat_sockets": len(self.sockets),
            "recoveries": [{"room": r.room, "reason": r.reason, "lost_agent": r.lost_agent,
                            "ago_s": round(now - r.at, 2), "dispatch_id": r.dispatch_id,
                            "error": r.error} for r in self.recoveries[-50:]],
        })  # fmt: skip

    # -- decisions ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        next_sweep = 0.0
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            try:
                self.check(now)
            except Exception:
                logger.exception("keeper check failed")
            if now >= next_sweep:
                next_sweep = now + self.sweep_s
                try:
                    await asyncio.wait_for(self.sweep(), max(self.sweep_s, 2.0))
                except Exception as e:  # the server is down or restarting: the next sweep
                    logger.debug("room list: %s: %s", type(e).__name__, e)

    async def sweep(self) -> list[str]:
        """Rooms with participants on the server that the keeper does not watch are watched from
        now on (webhooks are best effort: one lost, a restarted keeper, a room started again on a
        restarted server while a decision about its old one was under way). Returns them."""
        assert self._lk is not None
        rooms = (await self._lk.room.list_rooms(api.ListRoomsRequest())).rooms
        now, added = time.monotonic(), []
        for room in rooms:
            if room.num_participants > 0 and room.name not in self.rooms:
                self.rooms[room.name] = RoomWatch(started=now)
                added.append(room.name)
        if added:
            logger.info("watching %d room(s) no webhook told of: %s", len(added), ", ".join(added))
        return added

    def check(self, now: float) -> None:
        for name, watch in list(self.rooms.items()):
            for identity, beat in list(watch.agents.items()):  # undecided (room busy): next check
                if now - beat > self.heartbeat_timeout and self._decide(
                    name, f"no heartbeat from {identity} for {now - beat:.1f}s", identity
                ):
                    del watch.agents[identity]
            for identity, at in list(watch.left.items()):
                if now - at >= LEFT_GRACE and self._decide(
                    name, f"agent {identity} left the room", identity
                ):
                    del watch.left[identity]
            waited = now - max(watch.started, watch.last_dispatch or watch.started)
            if (
                not watch.agents
                and not watch.left
                and now >= watch.quiet_until
                and waited > self.dispatch_wait
            ):
                self._decide(name, f"no agent after {waited:.1f}s", None)

    def _decide(self, room: str, reason: str, lost: str | None) -> bool:
        """Start a recovery of `room`; False (nothing done) while one is in flight for it."""
        if room in self._busy:
            return False
        self._busy.add(room)
        self.decisions.append((room, reason))
        watch = self.rooms.setdefault(room, RoomWatch(started=time.monotonic()))
        watch.last_dispatch = time.monotonic()  # also paces retries when nobody is there
        task = asyncio.create_task(self._recover(room, reason, lost, watch))
        task.add_done_callback(lambda _t: self._busy.discard(room))
        return True

    async def _recover(self, room: str, reason: str, lost: str | None, watch: RoomWatch) -> None:
        """Remove the lost agent (if any); dispatch a new one if a caller is still there. `watch`:
        the room's watch when this was decided; a room started again meanwhile (a webhook while
        the LiveKit calls below were on their way) has a new one, which is not forgotten here."""
        assert self._lk is not None
        if lost is not None:
            try:
                await self._lk.room.remove_participant(
                    api.RoomParticipantIdentity(room=room, identity=lost)
                )
            except api.TwirpError as e:  # already gone
                logger.debug("remove %s from %s: %s", lost, room, e)
        try:
            people = (
                await self._lk.room.list_participants(api.ListParticipantsRequest(room=room))
            ).participants
        except api.TwirpError as e:
            if e.code == api.TwirpErrorCode.NOT_FOUND:
                self._forget(room, watch)
                return
            raise
        except aiohttp.ClientError as e:  # the server is down (restarting): the next check retries
            logger.warning("room %s: %s; LiveKit unreachable: %s", room, reason, e)
            return
        callers = [p for p in people if p.kind in CALLER_KINDS]
        agents = [p for p in people if self._ours(p) and p.identity != lost]
        if not callers:
            if not agents:
                self._forget(room, watch)  # nobody waits: LiveKit closes the room by itself
            return
        if agents:
            return  # another agent is there already
        current = self.rooms.get(
            room
        )  # the room's watch now (the one this was decided for, or newer)
        if (
            current is not None
            and current.dispatch_id is not None
            and not await self._retire(room, current.dispatch_id)
        ):
            return  # our last dispatch was given to a worker: its agent is on the way
        recovery = Recovery(room, reason, lost, time.monotonic())
        try:
            dispatch = await self._lk.agent_dispatch.create_dispatch(
                api.CreateAgentDispatchRequest(
                    agent_name=self.agent_name,
                    room=room,
                    metadata=json.dumps({"resume": lost is not None, "reason": reason}),
                )
            )
            recovery.dispatch_id = dispatch.id
            if current is not None:
                current.dispatch_id = dispatch.id
            logger.warning("room %s: %s; dispatched a new agent (%s)", room, reason, dispatch.id)
        except asyncio.CancelledError:  # the keeper stops
            recovery.error = "cancelled: the keeper stopped"
            raise
        except Exception as e:
            recovery.error = f"{type(e).__name__}: {e}"
            logger.error("room %s: %s; dispatch failed: %s", room, reason, recovery.error)
        finally:  # published once the dispatch call has returned or failed: readers see its outcome
            self.recoveries.append(recovery)

    def _forget(self, room: str, watch: RoomWatch) -> None:
        if self.rooms.get(room) is watch:
            del self.rooms[room]

    async def _retire(self, room: str, dispatch_id: str) -> bool:
        """Our earlier dispatch: True when it may be replaced (no worker took it: it is deleted, so
        that it cannot add a second agent later); False while a worker's job is on its way
        (for up to JOIN_WAIT after it was assigned)."""
        assert self._lk is not None
        try:
            dispatch = await self._lk.agent_dispatch.get_dispatch(dispatch_id, room)
        except api.TwirpError:
            return True
        if dispatch is None:
            return True
        jobs = list(dispatch.state.jobs)
        if (
            jobs
            and time.time() - max(j.state.updated_at or j.state.started_at for j in jobs) / 1e9
            < JOIN_WAIT
        ):
            return False
        try:
            await self._lk.agent_dispatch.delete_dispatch(dispatch_id, room)
        except api.TwirpError as e:
            logger.debug("delete dispatch %s: %s", dispatch_id, e)
        return True


def run_keeper(settings) -> int:
    """`voice-agent keeper` (blocks until Ctrl-C / SIGTERM)."""
    if not (settings.livekit_url and settings.livekit_api_key and settings.livekit_api_secret):
        raise SystemExit(
            "voice-agent: error: keeper needs LIVEKIT_URL, LIVEKIT_API_KEY and LIVEKIT_API_SECRET"
        )
    keeper = CallKeeper(settings.livekit_url, settings.livekit_api_key, settings.livekit_api_secret,
                        agent_name=settings.agent_name, heartbeat_timeout=settings.keeper_heartbeat_timeout,
                        dispatch_wait=settings.keeper_dispatch_wait)  # fmt: skip
    print(
        f"voice-agent keeper on http://{settings.keeper_host}:{settings.keeper_port} "
        "(POST /webhook for LiveKit, /v1/heartbeat for jobs; GET /v1/status)",
        flush=True,
    )
    web.run_app(keeper.app(), host=settings.keeper_host, port=settings.keeper_port, print=None)
    return 0
