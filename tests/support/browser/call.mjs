// Drives Debian's Chromium (through playwright-core, no browser download) through the voice
// agent's browser client, as tests/system/test_browser_client.py asks:
//
//   node tests/support/browser/call.mjs --url http://127.0.0.1:PORT/ --wav question.wav \
//       --room NAME --words what,time --agent-words noon --screenshot out.png \
//       [--chromium /usr/bin/chromium] [--timeout 60]
//
// The WAV (16-bit PCM) is the microphone: the page's getUserMedia gets a WebAudio track that is
// silent until the question is played into it, once, when the agent has subscribed to it (the
// event LiveKit sends the publisher), so the agent hears all of it however long it took to join.
// The script clicks Join and waits, each step bounded by what is left of --timeout, for:
// connected, the agent in the room, the agent's subscription to the microphone (then the question
// plays), the user's transcript holding every --words word, audible agent audio (the page's
// analyser), a number in the latency readout, and an agent transcript holding every
// --agent-words word (it follows the agent's playout). It saves a screenshot, clicks Leave, and
// prints one JSON object on stdout (ok, steps: seconds since Join, failed step and error, the
// page's state, console errors, and the page clock's (performance.now) times since Join: of each
// step's end (page_steps_ms) and of the question's start (question_start_ms)).
// Exit code 0 when every step passed, 1 otherwise; 2 for bad arguments.
import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { chromium } from 'playwright-core';

let opt;
try {
  ({ values: opt } = parseArgs({
    options: {
      url: { type: 'string' },
      wav: { type: 'string' },
      room: { type: 'string', default: '' },
      words: { type: 'string', default: '' },
      'agent-words': { type: 'string', default: '' },
      screenshot: { type: 'string' },
      chromium: { type: 'string', default: '/usr/bin/chromium' },
      timeout: { type: 'string', default: '60' },
    },
  }));
  if (!opt.url || !opt.wav || !opt.screenshot) throw new Error('--url, --wav and --screenshot are required');
} catch (e) {
  console.error(`call.mjs: ${e.message}`);
  process.exit(2);
}

const ARGS = [
  '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
  '--disable-sync', '--use-fake-ui-for-media-stream', '--use-fake-device-for-media-stream',
  '--autoplay-policy=no-user-gesture-required', // the microphone's own AudioContext (below)
];
const WAV_BASE64 = readFileSync(opt.wav).toString('base64');

// Before the page's scripts: getUserMedia for audio answers with a track of one AudioContext,
// silent until window.__voiceTest.play() plays the question into it once (each call gets a
// clone, so a permission probe that stops its track leaves the published one alone).
function installMicrophone() {
  const test = { micSubscribedAt: null, questionStartedAt: null, play: null };
  window.__voiceTest = test;
  const media = navigator.mediaDevices;
  const original = media.getUserMedia.bind(media);
  let microphone = null;
  async function makeMicrophone() {
    const ctx = new AudioContext();
    await ctx.resume();
    const b64 = await window.__questionWav();
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const question = await ctx.decodeAudioData(bytes.buffer);
    const dest = ctx.createMediaStreamDestination();
    test.play = () => {
      const source = ctx.createBufferSource();
      source.buffer = question;
      source.connect(dest);
      test.questionStartedAt = performance.now();
      source.start();
    };
    return dest.stream.getAudioTracks()[0];
  }
  media.getUserMedia = async (constraints) => {
    if (!constraints || !constraints.audio) return original(constraints);
    microphone = microphone || makeMicrophone();
    const stream = new MediaStream([(await microphone).clone()]);
    if (constraints.video) {
      for (const track of (await original({ video: constraints.video })).getVideoTracks()) stream.addTrack(track);
    }
    return stream;
  };
}
const wordList = (s) => s.split(',').map((w) => w.trim().toLowerCase()).filter(Boolean);
const words = { user: wordList(opt.words), agent: wordList(opt['agent-words']) };
const deadline = Date.now() + Number(opt.timeout) * 1000;
const left = () => Math.max(1, deadline - Date.now());
const result = {
  ok: false, steps: {}, page_steps_ms: {}, question_start_ms: null, failed: null, error: null,
  console: [], page_errors: [],
};

// The page's state, read from the DOM only (what a person sees, and what the test asserts on).
function pageState() {
  const $ = (id) => document.getElementById(id);
  const num = (v) => (v === undefined || v === '' ? null : Number(v));
  return {
    connection: $('connection').dataset.state,
    room: $('room-name').dataset.room,
    agent_state: $('agent-state').dataset.state,
    transcript: [...document.querySelectorAll('#transcript > li')].map((li) => ({
      speaker: li.dataset.speaker, text: li.textContent, final: li.dataset.final === 'true',
    })),
    mic_heard: $('mic-level').dataset.heard === 'true',
    agent_heard: $('agent-level').dataset.heard === 'true',
    latency_ms: num($('latency').dataset.ms),
    latency_after_turn_ms: num($('latency-turn').dataset.ms),
    latency_turns: num($('latency').dataset.turns),
    latency_text: $('latency').textContent,
    error: $('error').hidden ? null : $('error').textContent,
  };
}

const STEPS = [
  ['connected', () => document.getElementById('connection').dataset.state === 'connected'],
  ['agent_joined', () => !!document.getElementById('agent-state').dataset.state],
  ['agent_listening', () => ['listening', 'thinking', 'speaking']
    .includes(document.getElementById('agent-state').dataset.state)],
  // LiveKit tells the publisher when the agent subscribes: from then on it hears the microphone
  ['mic_subscribed', () => window.__voiceTest.micSubscribedAt !== null && !!window.__voiceTest.play],
  ['user_transcript', (ws) => {
    const text = [...document.querySelectorAll('#transcript > li[data-speaker="user"]')]
      .map((li) => li.textContent.toLowerCase()).join(' ');
    return ws.user.every((w) => text.includes(w));
  }],
  ['agent_audio', () => document.getElementById('agent-level').dataset.heard === 'true'],
  ['latency', () => /^\d+$/.test(document.getElementById('latency').dataset.ms || '')],
  ['agent_transcript', (ws) => {
    const text = [...document.querySelectorAll('#transcript > li[data-speaker="agent"]')]
      .map((li) => li.textContent.toLowerCase()).join(' ');
    return text.trim().length > 0 && ws.agent.every((w) => text.includes(w));
  }],
];

let browser;
let page;
const t0 = Date.now();
try {
  browser = await chromium.launch({
    executablePath: opt.chromium, headless: true, args: ARGS, timeout: left(),
    ignoreDefaultArgs: ['--mute-audio'], // keep the audio path as a person's browser has it
  });
  result.browser_version = browser.version();
  result.launch_s = (Date.now() - t0) / 1000;
  page = await browser.newPage();
  page.on('console', (m) => {
    if (m.type() === 'error' || m.type() === 'warning') result.console.push(`${m.type()}: ${m.text()}`);
  });
  page.on('pageerror', (e) => result.page_errors.push(String(e)));
  await page.exposeFunction('__questionWav', () => WAV_BASE64);
  await page.addInitScript(installMicrophone);
  await page.goto(opt.url, { timeout: left() });
  await page.waitForFunction(() => document.body.dataset.ready === 'true', null, { timeout: left() });
  // the room's LocalTrackSubscribed event, noted whenever it comes (before Join: no room yet)
  await page.evaluate(() => {
    const { Room, RoomEvent } = window.LivekitClient;
    const emit = Room.prototype.emit;
    Room.prototype.emit = function (event, ...args) {
      if (event === RoomEvent.LocalTrackSubscribed && window.__voiceTest.micSubscribedAt === null) {
        window.__voiceTest.micSubscribedAt = performance.now();
      }
      return emit.call(this, event, ...args);
    };
  });
  if (opt.room) await page.fill('#room', opt.room);
  const tJoin = Date.now();
  const pageJoin = await page.evaluate(() => performance.now());
  await page.click('#join', { timeout: left() });
  for (const [name, fn] of STEPS) {
    result.failed = name;
    await page.waitForFunction(fn, words, { timeout: left(), polling: 50 });
    result.steps[name] = (Date.now() - tJoin) / 1000;
    result.page_steps_ms[name] = (await page.evaluate(() => performance.now())) - pageJoin;
    if (name === 'mic_subscribed') {
      const started = await page.evaluate(() => { window.__voiceTest.play(); return window.__voiceTest.questionStartedAt; });
      result.question_start_ms = started - pageJoin;
    }
  }
  result.failed = null;
  result.ok = true;
} catch (e) {
  result.error = String(e && e.message ? e.message.split('\n')[0] : e);
}

if (page) {
  try { result.state = await page.evaluate(pageState); } catch (e) { result.state_error = String(e); }
  try {
    await page.screenshot({ path: opt.screenshot, fullPage: true, timeout: 60000 });
    result.screenshot = opt.screenshot;
  } catch (e) { result.screenshot_error = String(e); }
  try {
    if (result.state && result.state.connection !== 'disconnected') {
      // bounds only a hang reaches (a loaded machine may take seconds)
      await page.click('#leave', { timeout: 60000 });
      await page.waitForFunction(() => document.getElementById('connection').dataset.state === 'disconnected',
        null, { timeout: 60000 });
      result.left_room = true;
    }
  } catch (e) { result.leave_error = String(e); }
}
if (browser) await browser.close().catch(() => {});
result.total_s = (Date.now() - t0) / 1000;
process.stdout.write(`${JSON.stringify(result)}\n`);
process.exit(result.ok ? 0 : 1);
