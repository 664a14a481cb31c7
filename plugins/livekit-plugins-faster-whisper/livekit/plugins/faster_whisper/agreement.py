"""The decisions of streaming recognition, without I/O: when to run a whisper pass, what audio
it sees, which words are committed (LocalAgreement-2, as in whisper_streaming) and what is final.

`UtteranceTracker` takes 16 kHz mono float samples and word lists; `stt.SpeechStream` runs it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

SAMPLE_RATE = 16000
_BLOCK = SAMPLE_RATE // 50  # 20 ms: the energy gate's unit


@dataclass(frozen=True)
class Word:
    """A recognised word; times in seconds (of the decoded window, or of the stream once placed)."""

    text: str  # as whisper spells it, leading space and punctuation included
    start: float
    end: float
    probability: float = 1.0

    @property
    def key(self) -> str:
        return normalize(self.text)


def normalize(text: str) -> str:
    """Lower case, no punctuation: what two passes must agree on."""
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


def words_text(words: Sequence[Word]) -> str:
    return "".join(w.text for w in words).strip()


def agreed_prefix(previous: Sequence[Word], current: Sequence[Word]) -> int:
    """How many leading words two consecutive hypotheses share (LocalAgreement-2)."""
    n = 0
    for a, b in zip(previous, current, strict=False):
        if a.key != b.key or not a.key:
            break
        n += 1
    return n


def drop_repeats(committed: Sequence[Word], hypothesis: Sequence[Word], cut: float) -> list[Word]:
    """`hypothesis` (stream times) without what the committed words already say: words centred
    before the cut (re-heard in the window's overlap), then a leading 1-3 word n-gram that
    repeats the end of `committed` (a word re-heard across the cut)."""
    words = [w for w in hypothesis if (w.start + w.end) / 2 >= cut]
    if not committed or not words or words[0].start > cut + 1.0:
        return words
    for n in range(min(3, len(committed), len(words)), 0, -1):
        if [w.key for w in committed[-n:]] == [w.key for w in words[:n]]:
            return words[n:]
    return words


@dataclass(frozen=True)
class StreamingOptions:
    interval: float = 1.0
    """Seconds of new audio between two interim passes."""
    first_window: float = 1.0
    """The first pass of an utterance waits for this much audio (whisper needs some context)."""
    preroll: float = 0.3
    """Audio kept before the first voiced block, so a soft onset is not clipped."""
    tail_silence: float = 0.1
    """Unvoiced audio after speech that triggers a pass at once: the final can then reuse it."""
    overlap: float = 1.0
    """Audio before the cut that a window repeats, as acoustic context (its words are dropped)."""
    commit_lag: float = 2.0
    """Agreed words are committed only once this much audio follows them in the window."""
    max_window: float = 15.0
    """Longest uncommitted window; beyond it words are committed without agreement."""
    min_db: float = -50.0
    """A 20 ms block is voiced at or above this level (dBFS RMS)..."""
    margin_db: float = 12.0
    """...and at least this far above the tracked noise floor."""


@dataclass(frozen=True)
class Window:
    """Audio for one whisper pass: samples from stream sample `start`, and the text to prompt."""

    start: int
    audio: np.ndarray
    prompt: str
    final: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.audio)

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE


@dataclass
class UtteranceResult:
    """One finished utterance. Times are seconds of the stream's audio."""

    words: list[Word]
    start: float
    end: float
    passes: int
    """Interim passes run while it was spoken."""
    committed_at_flush: int
    """Words already committed when the flush came."""
    final_decoded: float
    """Seconds of audio decoded after the flush (0 when the last interim pass was reused)."""
    reused_pass: bool
    timed_out: bool = False
    """The final pass did not end within the stream's timeout: these are the interims' words."""

    @property
    def text(self) -> str:
        return words_text(self.words)

    @property
    def duration(self) -> float:
        return self.end - self.start


class EnergyGate:
    """Speech/non-speech per 20 ms block by loudness: at least `min_db`, and `margin_db` above
    a noise floor that follows quieter blocks down at once and rises slowly (2 dB/s), from a
    quiet room's level (`min_db - margin_db`) at the start."""

    RISE_DB_PER_S = 2.0

    def __init__(self, min_db: float, margin_db: float) -> None:
        self._min_db = min_db
        self._margin_db = margin_db
        self._floor = min_db - margin_db

    def voiced(self, block: np.ndarray) -> bool:
        rms = math.sqrt(float(np.mean(np.square(block, dtype=np.float64)))) if len(block) else 0.0
        db = 20.0 * math.log10(max(rms, 1e-5))  # -100 dBFS for digital silence
        voiced = db >= max(self._min_db, self._floor + self._margin_db)
        self._floor = min(db, self._floor + self.RISE_DB_PER_S * len(block) / SAMPLE_RATE)
        return voiced


class UtteranceTracker:
    """Audio and words of the utterance being spoken, plus the policy around whisper passes.

    Idle, it keeps `preroll` seconds of audio; the first voiced block starts an utterance. The
    caller asks `next_window()` whenever no pass is running, decodes it, and hands the words
    back to `apply()`: words that two consecutive passes agree on, and that `commit_lag`
    seconds of audio follow, are committed; the audio before the last committed word is
    dropped (the cut), so every later pass, and the final one, decodes only the uncommitted
    tail (plus `overlap` seconds before it, as context). On flush, `final_window()` is that
    tail, or None when the last pass already heard all the speech and the pause after it, and
    `finish()` closes the utterance.
    """

    def __init__(self, options: StreamingOptions | None = None) -> None:
        self.options = options or StreamingOptions()
        self._gate = EnergyGate(self.options.min_db, self.options.margin_db)
        self._chunks: list[np.ndarray] = []
        self._start = 0  # stream sample index of the first stored sample
        self._end = 0  # stream sample index after the last pushed sample
        self._gated = 0  # samples classified by the gate
        self._pending = np.zeros(0, np.float32)  # pushed but not yet a whole block
        self._reset_utterance(active=False)

    def _reset_utterance(self, *, active: bool) -> None:
        self.active = active
        self.committed: list[Word] = []
        self.tentative: list[Word] = []
        self._utterance_start = self._start
        self._cut = self._start
        self._voiced: list[int] = []  # start samples of the voiced blocks after the cut
        self._last_voiced_end = self._start
        self._window_end = self._start  # end of the audio the last pass heard
        self._passes = 0
        self._heard_all = False  # the last pass heard every voiced block

    # -- audio in ---------------------------------------------------------------------------

    @property
    def end_sample(self) -> int:
        return self._end

    def push(self, samples: np.ndarray) -> bool:
        """Add audio (16 kHz mono float32); True when it started an utterance."""
        if not len(samples):
            return False
        samples = np.asarray(samples, dtype=np.float32)
        self._chunks.append(samples)
        self._end += len(samples)
        self._pending = np.concatenate([self._pending, samples])
        started = False
        while len(self._pending) >= _BLOCK:
            block, self._pending = self._pending[:_BLOCK], self._pending[_BLOCK:]
            block_start = self._gated
            self._gated += _BLOCK
            if not self._gate.voiced(block):
                continue
            if not self.active:
                self._reset_utterance(active=True)
                self._drop_before(
                    max(self._start, block_start - self._seconds(self.options.preroll))
                )
                self._utterance_start = self._cut = self._window_end = self._start
                started = True
            self._voiced.append(block_start)
            self._last_voiced_end = block_start + _BLOCK
            self._heard_all = False
        if not self.active:
            self._drop_before(max(self._start, self._gated - self._seconds(self.options.preroll)))
        return started

    # -- passes -----------------------------------------------------------------------------

    def next_window(self) -> Window | None:
        """The audio for an interim pass now, or None when none is due. A pass is due once
        speech has been followed by `tail_silence` (the final can then reuse it), or after
        `interval` seconds of new audio holding speech no pass has heard; never when the last
        pass heard everything up to a pause."""
        if not self.active or self._heard_all:
            return None
        o = self.options
        if self._end - self._last_voiced_end >= self._seconds(o.tail_silence):
            return self._window(final=False)  # speech paused or ended: hear all of it now
        due = (
            self._last_voiced_end > self._window_end
            and self._end - self._window_end >= self._seconds(o.interval)
            and (self._passes > 0 or self._end - self._cut >= self._seconds(o.first_window))
        )
        return self._window(final=False) if due else None

    def apply(self, window: Window, words: Sequence[Word]) -> str:
        """Take a pass's words (times in seconds of `window`); returns the interim text."""
        o = self.options
        self._passes += not window.final
        self._window_end = max(self._window_end, window.end)
        cut_s = self._cut / SAMPLE_RATE
        offset = window.start / SAMPLE_RATE
        hypothesis = [replace(w, start=w.start + offset, end=w.end + offset) for w in words]
        hypothesis = drop_repeats(self.committed, hypothesis, cut_s)

        n = agreed_prefix(self.tentative, hypothesis)
        settled = window.end / SAMPLE_RATE - o.commit_lag
        while n and hypothesis[n - 1].end > settled:
            n -= 1
        if window.seconds > o.max_window:
            n = max(n, len(hypothesis) - 1)  # no agreement in a whole window: keep it anyway
        self.committed += hypothesis[:n]
        self.tentative = hypothesis[n:]
        if n:
            self._advance_cut(self._cut_after(hypothesis[n - 1]))
        elif not hypothesis and window.seconds >= 2.0:
            # nothing heard in two seconds: noise, not words; keep the last second only
            self._advance_cut(window.end - SAMPLE_RATE)
        self._heard_all = (
            window.end >= self._last_voiced_end + self._seconds(o.tail_silence) - _BLOCK
        )
        return self.text

    def _cut_after(self, word: Word) -> int:
        following = self.tentative[0].start if self.tentative else word.end
        return round(max(word.end, min(following, word.end + 0.1)) * SAMPLE_RATE)

    @property
    def text(self) -> str:
        return words_text(self.committed + self.tentative)

    def heard(self, silence: float) -> bool:
        """True once a pass has heard all the speech of the utterance and `silence` seconds of
        unvoiced audio have followed its last voiced block: its words are the final."""
        return (
            self.active
            and self._passes > 0
            and self._heard_all
            and self._end - self._last_voiced_end >= self._seconds(silence)
        )

    def final_window(self) -> Window | None:
        """The audio the final pass must decode: everything after the cut; None when the last
        pass heard all the voiced audio (its words are the final) or nothing is left to hear."""
        if not self.active:
            return None
        if self._passes and self._heard_all:
            return None
        window = self._window(final=True)
        if not any(v >= window.start for v in self._voiced):
            return None
        return window

    def finish(
        self, window: Window | None = None, words: Sequence[Word] = (), *, timed_out: bool = False
    ) -> UtteranceResult | None:
        """Close the utterance (after a flush) with the final pass's words, if one was run;
        `timed_out`: no final pass came back in time, the words are those the passes heard."""
        if not self.active:
            return None
        committed_at_flush = len(self.committed)
        reused = window is None and not timed_out and self._passes > 0 and self._heard_all
        if window is not None:
            self.apply(window, words)
        all_words = self.committed + self.tentative
        result = UtteranceResult(
            words=all_words,
            start=self._utterance_start / SAMPLE_RATE,
            end=self._end / SAMPLE_RATE,
            passes=self._passes,
            committed_at_flush=committed_at_flush,
            final_decoded=window.seconds if window is not None else 0.0,
            reused_pass=reused,
            timed_out=timed_out,
        )
        self._drop_before(self._end)
        self._reset_utterance(active=False)
        # audio after a flush belongs to the next utterance: the gate starts afresh there
        self._gated = self._end
        self._pending = np.zeros(0, np.float32)
        return result

    # -- audio storage ----------------------------------------------------------------------

    def _window(self, *, final: bool) -> Window:
        o = self.options
        if not self.tentative:
            # nothing pending: skip unvoiced audio before the next speech (whisper invents
            # words in long silences), keeping a pre-roll
            first_voiced = next((v for v in self._voiced if v >= self._cut), None)
            if first_voiced is not None:
                self._advance_cut(first_voiced - self._seconds(o.preroll))
        start = max(
            self._start, self._cut - self._seconds(o.overlap) if self.committed else self._cut
        )
        audio = self._audio()[start - self._start : self._end - self._start]
        # the prompt is the text before the window: words it re-hears are left for it to hear
        start_s = start / SAMPLE_RATE
        prompt = words_text([w for w in self.committed if w.end <= start_s + 0.05])[-200:]
        return Window(start=start, audio=audio, prompt=prompt, final=final)

    def _advance_cut(self, sample: int) -> None:
        sample = min(sample, self._end)
        if sample <= self._cut:
            return
        self._cut = sample
        self._voiced = [v for v in self._voiced if v + _BLOCK > sample]
        self._drop_before(sample - self._seconds(self.options.overlap))

    def _audio(self) -> np.ndarray:
        if len(self._chunks) != 1:
            self._chunks = [
                np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
            ]
        return self._chunks[0]

    def _drop_before(self, sample: int) -> None:
        if sample <= self._start:
            return
        sample = min(sample, self._end)
        self._chunks = [self._audio()[sample - self._start :]]
        self._start = sample

    @staticmethod
    def _seconds(s: float) -> int:
        return round(s * SAMPLE_RATE)


@dataclass
class StreamStats:
    """What a stream has decoded so far (for tests and benchmarks)."""

    passes: int = 0
    """Whisper passes run, interim and final."""
    decoded_seconds: float = 0.0
    """Audio those passes decoded."""
    utterances: list[UtteranceResult] = field(default_factory=list)
