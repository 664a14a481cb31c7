// Drives Debian's Chromium (through playwright-core, no browser download) through the voice
// agent's browser client, as tests/system/test_browser_client.py asks:
//
//   node tests/support/browser/call.mjs --url http://127.0.0.1:PORT/ --wav question.wav \
//       --room NAME --words what,time --agent-words noon --screenshot out.png \
//       [--chromium /usr/bin/chromium] [--timeout 60]
//
// The WAV (16-bit PCM) is the fake microphone: Chromium plays it once (%noloop) from the moment
// the page opens the microphone. The script clicks Join and waits, each step bounded by what is
// left of --timeout, for: connected, the agent in the room, the user's transcript holding every
// --words word, audible agent audio (the page's analyser), a number in the latency readout, and
// an agent transcript holding every --agent-words word (it follows the agent's playout). It saves a screenshot, clicks Leave, and prints one JSON object on
// stdout (ok, steps: seconds since Join, failed step and error, the page's state, console errors).
// Exit code 0 when every step passed, 1 otherwise; 2 for bad arguments.
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
  `--use-file-for-fake-audio-capture=${opt.wav}%noloop`,
];
const wordList = (s) => s.split(',').map((w) => w.trim().toLowerCase()).filter(Boolean);
const words = { user: wordList(opt.words), agent: wordList(opt['agent-words']) };
const deadline = Date.now() + Number(opt.timeout) * 1000;
const left = () => Math.max(1, deadline - Date.now());
const result = { ok: false, steps: {}, failed: null, error: null, console: [], page_errors: [] };

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
  await page.goto(opt.url, { timeout: left() });
  await page.waitForFunction(() => document.body.dataset.ready === 'true', null, { timeout: left() });
  if (opt.room) await page.fill('#room', opt.room);
  const tJoin = Date.now();
  await page.click('#join', { timeout: left() });
  for (const [name, fn] of STEPS) {
    result.failed = name;
    await page.waitForFunction(fn, words, { timeout: left(), polling: 50 });
    result.steps[name] = (Date.now() - tJoin) / 1000;
  }
  result.failed = null;
  result.ok = true;
} catch (e) {
  result.error = String(e && e.message ? e.message.split('\n')[0] : e);
}

if (page) {
  try { result.state = await page.evaluate(pageState); } catch (e) { result.state_error = String(e); }
  try {
    await page.screenshot({ path: opt.screenshot, fullPage: true, timeout: 15000 });
    result.screenshot = opt.screenshot;
  } catch (e) { result.screenshot_error = String(e); }
  try {
    if (result.state && result.state.connection !== 'disconnected') {
      await page.click('#leave', { timeout: 5000 });
      await page.waitForFunction(() => document.getElementById('connection').dataset.state === 'disconnected',
        null, { timeout: 5000 });
      result.left_room = true;
    }
  } catch (e) { result.leave_error = String(e); }
}
if (browser) await browser.close().catch(() => {});
result.total_s = (Date.now() - t0) / 1000;
process.stdout.write(`${JSON.stringify(result)}\n`);
process.exit(result.ok ? 0 : 1);
