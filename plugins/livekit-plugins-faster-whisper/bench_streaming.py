"""Latency of the final transcript: streaming (`STT(streaming=True)`) vs non-streaming recognize().

Each turn is an espeak-ng question at 48 kHz in 20 ms frames, pushed in real time like a caller's
microphone: 0.3 s of silence, the question, then `--trailing` seconds of silence (0.6: Silero's
0.55 s end-of-speech window), then the flush LiveKit sends at the VAD's end of speech. The latency
is flush -> FINAL_TRANSCRIPT for the stream, and the recognize() call of the same audio for the
non-streaming path (what the VAD StreamAdapter does at end of speech), in the same process. A
second round flushes right at the end of the speech (espeak's trailing silence cut off): the
final pass must then decode the uncommitted tail. Prints JSON.

    python plugins/livekit-plugins-faster-whisper/bench_streaming.py [--model bundled]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
from livekit import rtc
from livekit.agents import stt as lk_stt
from livekit.plugins import faster_whisper

RATE = 48000
FRAME = RATE // 50  # 20 ms
QUESTIONS = [  # about 3 s each as espeak-ng says them
    "How long does it take to drive from here to the airport?",
    "Can you book me a taxi to the station for tomorrow morning?",
    "Could you tell me what the weather will be like in Paris?",
]


def espeak(text: str, rate: int = RATE) -> np.ndarray:
    """int16 mono samples of `text` spoken by espeak-ng, resampled to `rate`."""
    if shutil.which("espeak-ng") is None:
        sys.exit("needs espeak-ng (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), "--", text], check=True)
        with wave.open(str(path), "rb") as w:
            source_rate = w.getframerate()
            samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16)
    resampler = rtc.AudioResampler(source_rate, rate, quality=rtc.AudioResamplerQuality.HIGH)
    frames = resampler.push(rtc.AudioFrame(samples.tobytes(), source_rate, 1, len(samples)))
    frames += resampler.flush()
    return np.concatenate([np.frombuffer(bytes(f.data), np.int16) for f in frames])


def frames_of(samples: np.ndarray) -> list[rtc.AudioFrame]:
    samples = np.pad(samples, (0, -len(samples) % FRAME))
    return [
        rtc.AudioFrame(samples[i : i + FRAME].tobytes(), RATE, 1, FRAME)
        for i in range(0, len(samples), FRAME)
    ]


async def streamed_turn(stt: faster_whisper.STT, frames: list[rtc.AudioFrame], speed: float):
    """Push frames at `speed` x real time, flush; (flush -> final seconds, utterance stats)."""
    stream = stt.stream()
    final_at: list[float] = []

    async def read() -> None:
        async for ev in stream:
            if ev.type == lk_stt.SpeechEventType.FINAL_TRANSCRIPT:
                final_at.append(time.perf_counter())

    reader = asyncio.create_task(read())
    start = time.perf_counter()
    for i, frame in enumerate(frames):
        stream.push_frame(frame)
        await asyncio.sleep(max(0.0, start + (i + 1) * 0.02 / speed - time.perf_counter()))
    flushed_at = time.perf_counter()
    stream.flush()
    stream.end_input()
    await reader
    await stream.aclose()
    (utterance,) = stream.stats.utterances
    return final_at[0] - flushed_at, utterance


async def bench(
    *,
    model: str,
    questions: list[str],
    trailing: float,
    interval: float = 1.0,
    speed: float = 1.0,
) -> dict[str, object]:
    streaming = faster_whisper.STT(model=model, streaming=True, interim_interval=interval)
    plain = faster_whisper.STT(model=model)
    streaming.load()
    turns = []
    for text in questions:
        speech = espeak(text)
        voiced_end = int(np.flatnonzero(np.abs(speech) > 300)[-1]) + 1
        silence = np.zeros(int(0.3 * RATE), np.int16)
        rounds = {
            "vad_flush": np.concatenate(
                [silence, speech, np.zeros(int(trailing * RATE), np.int16)]
            ),
            "flush_at_speech_end": np.concatenate([silence, speech[:voiced_end]]),
        }
        turn: dict[str, object] = {"text": text, "speech_s": round(voiced_end / RATE, 2)}
        for name, audio in rounds.items():
            frames = frames_of(audio)
            latency, utterance = await streamed_turn(streaming, frames, speed)
            t0 = time.perf_counter()
            reference = await plain.recognize(frames)
            recognize_s = time.perf_counter() - t0
            turn[name] = {
                "audio_s": round(len(audio) / RATE, 2),
                "streaming_final_s": round(latency, 3),
                "recognize_s": round(recognize_s, 3),
                "interim_passes": utterance.passes,
                "final_decoded_s": round(utterance.final_decoded, 2),
                "reused_last_pass": utterance.reused_pass,
                "streaming_text": utterance.text,
                "recognize_text": reference.alternatives[0].text,
            }
        turns.append(turn)

    summary = {}
    for name in ("vad_flush", "flush_at_speech_end"):
        s = statistics.median(t[name]["streaming_final_s"] for t in turns)  # type: ignore[index]
        r = statistics.median(t[name]["recognize_s"] for t in turns)  # type: ignore[index]
        summary[name] = {
            "streaming_final_s": round(s, 3),
            "recognize_s": round(r, 3),
            "ratio": round(s / r, 3) if r else None,
        }
    return {
        "model": model,
        "trailing_silence_s": trailing,
        "interim_interval_s": interval,
        "speed": speed,
        "median": summary,
        "turns": turns,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--trailing", type=float, default=0.6)
    parser.add_argument("--interval", type=float, default=1.0, help="interim_interval")
    parser.add_argument("--speed", type=float, default=1.0, help="x real time (1: a microphone)")
    parser.add_argument("questions", nargs="*", default=QUESTIONS)
    args = parser.parse_args()
    result = asyncio.run(
        bench(
            model=args.model,
            questions=args.questions,
            trailing=args.trailing,
            interval=args.interval,
            speed=args.speed,
        )
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
