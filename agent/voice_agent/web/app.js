// The voice agent's browser client, on LiveKit's JS client (window.LivekitClient, the UMD build
// that `voice-agent web` serves from node_modules). No build step, no framework.
//
// Start: GET /api/config says whether the server lets visitors name a room (WEB_ALLOW_ROOM_NAMES);
// only then is the room field shown. Join: POST /api/token ({} or {room}) -> connect to the room
// -> publish the microphone; the worker's automatic dispatch sends an agent into the room. A
// refused token (403, 409, 429, 503) shows the server's message in #error. The agent's audio plays in <audio id="agent-audio">;
// transcripts of both sides arrive as text streams on the topic `lk.transcription`.
//
// State for people and for tests lives in the DOM:
//   #connection[data-state]      disconnected | connecting | connected | reconnecting
//   #agent-state[data-state]     the agent's `lk.agent.state` (initializing, listening,
//                                thinking, speaking), "" while no agent is in the room
//   #transcript > li             data-speaker (user | agent), data-segment, data-final, the text
//   #mic-level, #agent-level     data-heard="true" once that side was audible, data-peak
//   #latency[data-ms]            voice-to-voice of the last answered turn (see below), data-turns
//   #latency-turn[data-ms]       the part after the agent's end of turn ("thinking" -> audio)
//
// Latency. Two WebAudio AnalyserNodes, read every 10 ms on one clock (performance.now()): one on
// the local microphone track, one on the agent's incoming track. A 10 ms read counts as sound
// when its peak is above SILENCE_PEAK. The voice-to-voice latency of a turn is the time from the
// last sound of the user (while the agent was silent) to the first sound of the agent's next
// utterance. It covers end-of-speech detection, STT, LLM, TTS and both network legs, but not the
// output device's own delay. Resolution: ~20 ms (the analyser window plus the read interval).
'use strict';

(() => {
  const LK = window.LivekitClient;
  const $ = (id) => document.getElementById(id);
  const TOPIC = 'lk.transcription';
  const ATTR = {
    track: 'lk.transcribed_track_id',
    final: 'lk.transcription_final',
    segment: 'lk.segment_id',
    agentState: 'lk.agent.state',
  };
  const SILENCE_PEAK = 0.01; // float samples, full scale 1 (about -40 dBFS)
  const TICK_MS = 10;
  const AGENT_GAP_MS = 300; // this long without agent sound ends an agent utterance
  const AGENT_HINT_MS = 15000; // no agent this long after joining: say what may be wrong

  let room = null;
  let audioCtx = null;
  let timer = null;
  let agentHintTimer = null;
  const meters = { mic: null, agent: null };
  const turn = { lastUserSound: null, userSpoke: false, thinkingAt: null, agentSounding: false, lastAgentSound: 0 };
  const lines = new Map(); // segment id -> <li>
  const latencies = []; // {voiceToVoiceMs, afterTurnMs, at}
  window.voiceAgentClient = { latencies, get room() { return room; } }; // for debugging

  function showError(message) {
    const el = $('error');
    el.textContent = message;
    el.hidden = !message;
  }

  function setConnection(state) {
    const el = $('connection');
    el.dataset.state = state;
    el.textContent = state;
    const busy = state !== 'disconnected';
    $('join').disabled = busy;
    $('leave').disabled = !busy;
    $('room').disabled = busy;
  }

  // --- the agent's state --------------------------------------------------------------------
  function agentParticipant() {
    if (!room) return null;
    for (const p of room.remoteParticipants.values()) {
      if (p.isAgent) return p;
    }
    return null;
  }

  function updateAgentState() {
    const agent = agentParticipant();
    const el = $('agent-state');
    const state = agent ? (agent.attributes[ATTR.agentState] || 'joining') : '';
    if (state === 'thinking' && el.dataset.state !== 'thinking') turn.thinkingAt = performance.now();
    el.dataset.state = state;
    el.textContent = agent ? state : 'not in the room';
    clearTimeout(agentHintTimer);
    if (!agent && room) {
      agentHintTimer = setTimeout(() => {
        if (room && !agentParticipant()) {
          el.textContent = 'not in the room yet: is a `voice-agent start` worker running, and below its load threshold?';
        }
      }, AGENT_HINT_MS);
    }
  }

  // --- transcripts --------------------------------------------------------------------------
  function lineFor(segment, speaker) {
    let li = lines.get(segment);
    if (!li) {
      li = document.createElement('li');
      li.dataset.segment = segment;
      li.dataset.speaker = speaker;
      li.dataset.final = 'false';
      lines.set(segment, li);
      $('transcript').appendChild(li);
    }
    return li;
  }

  function micPublication() {
    return room ? room.localParticipant.getTrackPublication(LK.Track.Source.Microphone) : undefined;
  }

  function onTranscription(reader, participantInfo) {
    const attrs = reader.info.attributes || {};
    const mic = micPublication();
    // The agent sends the user's transcript on the user's behalf (sender = the user's identity)
    // and stamps every transcript with the track it transcribes.
    const isUser = participantInfo.identity === room.localParticipant.identity
      || (!!attrs[ATTR.track] && !!mic && attrs[ATTR.track] === mic.trackSid);
    const li = lineFor(attrs[ATTR.segment] || reader.info.id, isUser ? 'user' : 'agent');
    (async () => {
      // A user segment comes as one stream per update (each the whole text so far), an agent
      // segment as one stream of deltas: either way this stream's text is the segment's text.
      let text = '';
      try {
        for await (const chunk of reader) {
          text += chunk;
          li.textContent = text;
        }
      } catch (e) {
        if (room) console.warn('transcription stream failed', e); // not when we left mid-stream
      }
      // the trailer's attributes are merged into reader.info when the stream ends
      if ((reader.info.attributes || {})[ATTR.final] === 'true') li.dataset.final = 'true';
    })();
  }

  // --- audio levels and latency ---------------------------------------------------------------
  function analyserFor(mediaStreamTrack) {
    const source = audioCtx.createMediaStreamSource(new MediaStream([mediaStreamTrack]));
    const analyser = audioCtx.createAnalyser();
    analyser.fftSize = 512; // ~10.7 ms at 48 kHz
    source.connect(analyser);
    return { source, analyser, buf: new Float32Array(analyser.fftSize) };
  }

  function closeMeter(name) {
    const m = meters[name];
    if (m) m.source.disconnect();
    meters[name] = null;
  }

  function peak(m) {
    if (!m) return 0;
    m.analyser.getFloatTimeDomainData(m.buf);
    let p = 0;
    for (const v of m.buf) { const a = Math.abs(v); if (a > p) p = a; }
    return p;
  }

  function showLevel(el, value) {
    el.style.width = `${Math.min(100, Math.round(Math.sqrt(value) * 100))}%`;
    el.dataset.peak = value.toFixed(4);
    if (value > SILENCE_PEAK) el.dataset.heard = 'true';
  }

  function showLatency(el, ms) {
    el.dataset.ms = ms === null ? '' : String(Math.round(ms));
    el.textContent = ms === null ? '–' : `${Math.round(ms)} ms`;
  }

  function onAgentOnset(now) {
    if (turn.userSpoke && turn.lastUserSound !== null) {
      const voiceToVoiceMs = now - turn.lastUserSound;
      const afterTurnMs = turn.thinkingAt !== null && turn.thinkingAt >= turn.lastUserSound
        ? now - turn.thinkingAt : null;
      latencies.push({ voiceToVoiceMs, afterTurnMs, at: Date.now() });
      showLatency($('latency'), voiceToVoiceMs);
      showLatency($('latency-turn'), afterTurnMs);
      $('latency').dataset.turns = String(latencies.length);
    }
    turn.userSpoke = false;
    turn.thinkingAt = null;
  }

  function tick() {
    const now = performance.now();
    const mic = peak(meters.mic);
    const agent = peak(meters.agent);
    showLevel($('mic-level'), mic);
    showLevel($('agent-level'), agent);
    if (agent > SILENCE_PEAK) {
      if (!turn.agentSounding) onAgentOnset(now);
      turn.agentSounding = true;
      turn.lastAgentSound = now;
    } else if (turn.agentSounding && now - turn.lastAgentSound > AGENT_GAP_MS) {
      turn.agentSounding = false;
    }
    // the user's sound counts only while the agent is silent (no echo of the agent's voice)
    if (mic > SILENCE_PEAK && !turn.agentSounding) {
      turn.lastUserSound = now;
      turn.userSpoke = true;
    }
  }

  // --- join / leave ---------------------------------------------------------------------------
  async function join(event) {
    event.preventDefault();
    showError('');
    const roomField = $('room');
    const roomName = roomField.hidden ? '' : roomField.value;
    if (roomName && !roomField.checkValidity()) {
      showError('Room names are 1-64 letters, digits, "_", "-" or ".", starting with a letter or digit.');
      return;
    }
    // created inside the click, so the browser lets it (and the <audio> element) play
    audioCtx = audioCtx || new AudioContext();
    audioCtx.resume().catch(() => {});
    setConnection('connecting');
    try {
      const res = await fetch('/api/token', {
        method: 'POST',
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify(roomName ? { room: roomName } : {}),
      });
      const body = await res.json().catch(() => ({}));
      if (!res.ok) throw new Error((body.error && body.error.message) || `token endpoint: HTTP ${res.status}`);
      await connect(body);
    } catch (e) {
      console.error(e);
      showError(`Could not join: ${e.message || e}`);
      if (room) await room.disconnect().catch(() => {});
      onDisconnected();
    }
  }

  async function connect({ url, token, room: roomName }) {
    room = new LK.Room();
    room
      .on(LK.RoomEvent.ConnectionStateChanged, (state) => setConnection(state))
      .on(LK.RoomEvent.Disconnected, onDisconnected)
      .on(LK.RoomEvent.ParticipantConnected, updateAgentState)
      .on(LK.RoomEvent.ParticipantDisconnected, updateAgentState)
      .on(LK.RoomEvent.ParticipantAttributesChanged, updateAgentState)
      .on(LK.RoomEvent.TrackSubscribed, (track) => {
        if (track.kind !== LK.Track.Kind.Audio) return;
        track.attach($('agent-audio'));
        closeMeter('agent');
        meters.agent = analyserFor(track.mediaStreamTrack);
      })
      .on(LK.RoomEvent.TrackUnsubscribed, (track) => {
        if (track.kind !== LK.Track.Kind.Audio) return;
        track.detach();
        closeMeter('agent');
      })
      .on(LK.RoomEvent.AudioPlaybackStatusChanged, () => {
        if (room && !room.canPlaybackAudio) {
          showError('The browser blocked the agent\'s audio: click anywhere on the page to allow it.');
          document.addEventListener('click', () => { room && room.startAudio(); showError(''); }, { once: true });
        }
      });
    room.registerTextStreamHandler(TOPIC, onTranscription);

    await room.connect(url, token);
    const name = $('room-name');
    name.dataset.room = roomName;
    name.textContent = `in room ${roomName}`;
    updateAgentState();
    timer = setInterval(tick, TICK_MS);
    try {
      const pub = await room.localParticipant.setMicrophoneEnabled(true);
      meters.mic = analyserFor(pub.track.mediaStreamTrack);
    } catch (e) {
      console.error(e);
      showError(`No microphone: ${e.message || e}. You can still hear the agent.`);
    }
  }

  function onDisconnected() {
    clearInterval(timer);
    timer = null;
    closeMeter('mic');
    closeMeter('agent');
    room = null;
    turn.lastUserSound = null;
    turn.userSpoke = false;
    turn.agentSounding = false;
    setConnection('disconnected');
    updateAgentState();
    const name = $('room-name');
    name.dataset.room = '';
    name.textContent = '';
  }

  async function leave() {
    if (room) await room.disconnect();
  }

  // The room field only where the server grants named rooms; without an answer, none.
  async function loadConfig() {
    let named = false;
    try {
      const res = await fetch('/api/config', { cache: 'no-store' });
      named = res.ok && (await res.json()).named_rooms === true;
    } catch (e) {
      console.warn('GET /api/config failed', e);
    }
    $('room-label').hidden = !named;
    $('room').hidden = !named;
    $('room-note').hidden = named;
  }

  if (!LK) {
    showError('livekit-client.umd.js did not load. Install it on the server with: '
      + 'npm ci --prefix agent/voice_agent/web (or bash scripts/install_browser.sh)');
    $('join').disabled = true;
    return;
  }
  LK.setLogLevel('warn');
  $('controls').addEventListener('submit', join);
  $('leave').addEventListener('click', leave);
  loadConfig().finally(() => { document.body.dataset.ready = 'true'; });
})();
