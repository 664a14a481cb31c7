"""No dead air: while no TTS engine can speak (every one full or down), the agent says a short
phrase ("One moment, please.") in its own voice, keeps trying, then apologises the same way.

`StandbyTTS` wraps the agent's TTS as LiveKit's `tts.FallbackAdapter` wraps several: a stream
forwards the reply's text to the wrapped TTS (which fails over between engines and retries by its
`conn_options`: the bounded "keeps trying") and its audio back. When no audio has come
`hold_after` s after the reply's text began and one of this reply's own attempts has failed (the
`error` event: the plugin raises only once every engine was full or down), the hold phrase plays;
when the wrapped stream then fails for good, or gives no audio within `give_up_after` s of the
phrase, the apology plays in place of the reply. A slow but healthy engine never triggers it.
Both phrases are synthesized by the wrapped TTS once an engine answers (`Phrases.fill`, started
by `prewarm()`), kept per voice for the process and on disk; until then, the bundled espeak-ng
clips (scripts/make_standby_clips.sh) are said.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import time
import wave
from pathlib import Path

import numpy as np
from livekit import rtc
from livekit.agents import APIConnectOptions, APIError, tts, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS

from voice_agent.observability import STANDBY

logger = logging.getLogger("voice_agent")
HOLD_PHRASE = "One moment, please."
APOLOGY_PHRASE = "Sorry, I can't answer right now. Please try again in a moment."
PHRASES = {"hold": HOLD_PHRASE, "apology": APOLOGY_PHRASE}
BUNDLED = Path(__file__).parent / "assets" / "standby"  # hold.wav, apology.wav
HOLD_AFTER_S = 1.0
GIVE_UP_AFTER_S = 10.0

# synthesized phrases of this process, by voice key: {key: {"hold": pcm, "apology": pcm}}
_SYNTHESIZED: dict[str, dict[str, bytes]] = {}
# one try each (the plugin still fails over between engines): a fill is retried by the next reply
_FILL_OPTIONS = APIConnectOptions(max_retry=0, timeout=DEFAULT_API_CONNECT_OPTIONS.timeout)
# Whose attempt an `error` event of the wrapped TTS reports. LiveKit emits it from the failed
# stream's own task, which copies the context of the code that called `stream()` or
# `synthesize()`: a reply's stream sets itself here before it opens the wrapped stream, the
# phrases' background synthesis sets None, so a reply counts only its own failed attempts (not a
# phrase synthesis that timed out, nor another reply's).
_ATTEMPT_OF: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "standby_attempt_of", default=None
)


class Phrases:
    """The two phrases as s16le mono PCM at `sample_rate`, for one voice (`key`): synthesized by
    the agent's TTS (this process's, else the copy in `cache_dir`), else the bundled clips."""

    def __init__(self, key: str, sample_rate: int, cache_dir: Path | None = None) -> None:
        self.key, self.sample_rate = f"{key}|{sample_rate}", sample_rate
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:16]
        self._files = None if cache_dir is None else cache_dir / "standby" / digest
        self._bundled: dict[str, bytes] = {}

    @property
    def synthesized(self) -> bool:
        return self._synthesized() is not None

    def get(self, name: str) -> tuple[bytes, str]:
        """(PCM, "engine" | "bundled") of the phrase `name` ("hold" or "apology")."""
        if (mine := self._synthesized()) is not None:
            return mine[name], "engine"
        if name not in self._bundled:
            self._bundled[name] = read_wav(BUNDLED / f"{name}.wav", self.sample_rate)
        return self._bundled[name], "bundled"

    def _synthesized(self) -> dict[str, bytes] | None:
        if self.key not in _SYNTHESIZED and self._files is not None:
            try:
                _SYNTHESIZED[self.key] = {
                    n: read_wav(self._files / f"{n}.wav", self.sample_rate) for n in PHRASES
                }
            except (OSError, wave.Error, EOFError):
                return None
        return _SYNTHESIZED.get(self.key)

    async def fill(self, speaker: tts.TTS, conn_options: APIConnectOptions) -> bool:
        """Synthesize both phrases with `speaker` (once per process and voice); whether they are
        now the engine's. A failure (no engine answers) leaves the bundled clips in use."""
        if self.synthesized:
            return True
        _ATTEMPT_OF.set(None)  # (this task's context) its failures are no reply's
        pcm = {}
        try:
            for name, text in PHRASES.items():
                frames = [
                    ev.frame async for ev in speaker.synthesize(text, conn_options=conn_options)
                ]
                pcm[name] = b"".join(bytes(f.data) for f in frames)
        except Exception as e:  # noqa: BLE001 (any failure: the bundled clips stay)
            logger.info("standby phrases not synthesized yet (%s: %s)", type(e).__name__, e)
            return False
        if not all(pcm.values()):
            return False
        _SYNTHESIZED[self.key] = pcm
        if self._files is not None:
            try:
                self._files.mkdir(parents=True, exist_ok=True)
                for name, data in pcm.items():
                    write_wav(self._files / f"{name}.wav", data, self.sample_rate)
            except OSError as e:
                logger.warning("standby phrases not saved in %s: %s", self._files, e)
        logger.info("standby phrases cached from the TTS (%s)", self.key)
        return True

    def path(self, name: str) -> Path | None:
        """Where the synthesized phrase `name` is saved (tests compare it with what was heard)."""
        return None if self._files is None else self._files / f"{name}.wav"


def read_wav(path: Path, sample_rate: int) -> bytes:
    """A 16-bit mono WAV as s16le PCM at `sample_rate`: resampled by linear interpolation (enough
    for a short spoken clip, and the same samples every time, which LiveKit's resampler's are
    not)."""
    with wave.open(str(path), "rb") as w:
        rate, data = w.getframerate(), w.readframes(w.getnframes())
    if rate == sample_rate:
        return data
    x = np.frombuffer(data, np.int16).astype(np.float64)
    t = np.arange(round(len(x) * sample_rate / rate)) * rate / sample_rate
    return np.round(np.interp(t, np.arange(len(x)), x)).astype(np.int16).tobytes()


def write_wav(path: Path, pcm: bytes, sample_rate: int) -> None:
    tmp = path.with_suffix(".tmp")
    with wave.open(str(tmp), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(sample_rate)
        w.writeframes(pcm)
    tmp.replace(path)


class StandbyTTS(tts.TTS):
    """The agent's TTS with a spoken standby (module docstring). `key` names the voice (the
    cached phrases are per voice); `hold_after` / `give_up_after` in seconds."""

    def __init__(self, inner: tts.TTS, *, key: str, hold_after: float = HOLD_AFTER_S,
                 give_up_after: float = GIVE_UP_AFTER_S, cache_dir: Path | None = None) -> None:  # fmt: skip
        super().__init__(capabilities=inner.capabilities, sample_rate=inner.sample_rate,
                         num_channels=inner.num_channels)  # fmt: skip
        self.inner, self.hold_after, self.give_up_after = inner, hold_after, give_up_after
        self.phrases = Phrases(key, inner.sample_rate, cache_dir)
        self._fill: asyncio.Task | None = None
        self._closed = False
        inner.on("metrics_collected", lambda *a: self.emit("metrics_collected", *a))
        inner.on("error", self._on_error)

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def provider(self) -> str:
        return self.inner.provider

    def _on_error(self, ev: tts.TTSError) -> None:
        """The wrapped TTS's failures: those of no engine being able to speak are covered here (the
        session sees them as recoverable); any other final one (a 4xx: a voice the engine does
        not have) is raised by the stream, which reports it itself."""
        if covered(ev.error):
            self.emit("error", ev.model_copy(update={"recoverable": True}))
        elif ev.recoverable:
            self.emit("error", ev)

    def prewarm(self) -> None:
        self.inner.prewarm()
        self.cache_phrases()

    def cache_phrases(self) -> asyncio.Task | None:
        """Synthesize the phrases in the background unless they are (or are being) already."""
        if self._closed or self.phrases.synthesized:
            return None
        if self._fill is None or self._fill.done():
            self._fill = asyncio.create_task(
                self.phrases.fill(self.inner, _FILL_OPTIONS), name="standby-phrases"
            )
        return self._fill

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ):
        return self.inner.synthesize(text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS):
        return StandbyStream(tts=self, conn_options=conn_options)

    async def aclose(self) -> None:
        self._closed = True
        if self._fill is not None:
            await utils.aio.cancel_and_wait(self._fill)
        await self.inner.aclose()


class StandbyStream(tts.SynthesizeStream):
    """One reply through the wrapped TTS's stream, covered by the phrases when it cannot speak."""

    def __init__(self, *, tts: StandbyTTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._standby = tts
        self.said: list[str] = []  # the phrases this reply said ("hold", "apology")
        self._text_began: float | None = None  # when the reply's first words came (monotonic)

    async def _metrics_monitor_task(self, event_aiter) -> None:
        async for _ in event_aiter:  # the wrapped TTS emits the metrics (forwarded)
            pass

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        standby = self._standby
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=standby.sample_rate,
                                  num_channels=1, mime_type="audio/pcm", stream=True)  # fmt: skip
        output_emitter.start_segment(segment_id=utils.shortuuid())
        text_began, refused = asyncio.Event(), asyncio.Event()  # refused: an attempt failed

        def on_error(ev: tts.TTSError) -> None:
            if _ATTEMPT_OF.get() is self and covered(ev.error):  # this reply's attempt failed
                refused.set()

        standby.inner.on("error", on_error)
        _ATTEMPT_OF.set(self)  # (this task's context, copied by the wrapped stream's task)
        inner = standby.inner.stream(conn_options=self._conn_options)
        audio: asyncio.Queue[rtc.AudioFrame | BaseException | None] = asyncio.Queue()

        async def forward_text() -> None:
            try:
                async for data in self._input_ch:
                    if isinstance(data, str):
                        if data.strip():
                            text_began.set()
                        inner.push_text(data)
                    else:
                        inner.flush()
            finally:
                inner.end_input()

        async def read_audio() -> None:
            try:
                async for ev in inner:
                    audio.put_nowait(ev.frame)
                audio.put_nowait(None)
            except Exception as e:  # noqa: BLE001 (its retries spent: the apology says it)
                audio.put_nowait(e)

        async def hold_due() -> None:
            await text_began.wait()
            t0 = self._text_began = time.monotonic()
            await refused.wait()  # a slow engine that has not failed is waited for, silently
            await asyncio.sleep(max(0.0, t0 + standby.hold_after - time.monotonic()))

        tasks = [asyncio.create_task(forward_text()), asyncio.create_task(read_audio())]
        hold = asyncio.create_task(hold_due())
        try:
            async with inner:
                first = await self._first(audio, hold)
                # LiveKit's TTFB counts from when the wrapped stream sent text to the engine (as
                # FallbackAdapter does): the frames this stream yields carry that time
                self._started_time = self._started_time or inner._started_time
                if first is _HOLD:
                    self._say("hold", output_emitter)
                    try:
                        async with asyncio.timeout(standby.give_up_after):
                            first = await audio.get()
                    except TimeoutError:
                        first = TimeoutError(f"no audio {standby.give_up_after:g} s after the hold")
                if isinstance(first, BaseException) and not covered(first):
                    raise first  # not for want of an engine: the session hears of it
                if isinstance(first, BaseException):
                    logger.warning("TTS could not speak the reply (%s: %s): apologising",
                                   type(first).__name__, first)  # fmt: skip
                    self._say("apology", output_emitter)
                    return
                item = first
                while isinstance(item, rtc.AudioFrame):
                    output_emitter.push(bytes(item.data))
                    item = await audio.get()
                if isinstance(item, BaseException) and not covered(item):
                    raise item
                if isinstance(item, BaseException):  # cut after some audio: no engine is left
                    logger.warning("TTS failed mid-reply (%s: %s): apologising",
                                   type(item).__name__, item)  # fmt: skip
                    self._say("apology", output_emitter)
                elif not standby.phrases.synthesized:
                    standby.cache_phrases()  # an engine answers: now the phrases can be its own
        finally:
            standby.inner.off("error", on_error)
            await utils.aio.cancel_and_wait(hold, *tasks)

    @staticmethod
    async def _first(audio: asyncio.Queue, hold: asyncio.Task):
        """The wrapped stream's first item (a frame, its error, or None: it ended), or _HOLD when
        the hold is due first."""
        get = asyncio.create_task(audio.get())
        try:
            await asyncio.wait({get, hold}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await get
        if get.done() and not get.cancelled():
            return get.result()
        return _HOLD

    def _say(self, name: str, emitter: tts.AudioEmitter) -> None:
        pcm, source = self._standby.phrases.get(name)
        emitter.push(pcm)
        self.said.append(name)
        STANDBY.labels(name, source).inc()
        began = self._text_began
        after = f", {time.monotonic() - began:.2f} s after the reply's text began" if began else ""
        logger.info("TTS standby: said the %s phrase (%s)%s", name, source, after)


_HOLD = object()


def covered(error: BaseException) -> bool:
    """A failure the standby speaks for: no engine could speak (every one down, full, stalled:
    LiveKit's retryable errors), or none within `give_up_after`."""
    return isinstance(error, TimeoutError) or (isinstance(error, APIError) and error.retryable)
