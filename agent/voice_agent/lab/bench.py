"""`voice-agent bench`: how soon the agent answers, and TTS under LLM contention (JSON).

1. Turn-taking: plain questions and questions with a pause in the middle, spoken through the
   pipeline twice in one run, with the configured settings ("tuned") and with the settings the
   pipeline had before its turn-taking work ("baseline": LiveKit's VAD window, no transcript
   check, no preemptive generation). Per turn: end of speech -> turn committed, -> final
   transcript, LLM time to first token and first sentence, TTS first audio, voice-to-voice,
   whether the turn was committed before the caller's last word; p50/p95 per column and the
   tuned/baseline ratios. The end of speech is the caller's last sample sent, as for
   voice-to-voice; LiveKit's own delays (`end_of_turn_delay_s`, `transcription_delay_s`) count
   from the VAD's end of speech, which Silero dates later (`vad_end_lag_s`). What the glue adds =
   voice-to-voice - (end of turn + LLM time to first sentence + TTS first-chunk compute); with
   preemptive generation only the LLM time after the commit counts, at most all of it from the
   final transcript on (an upper bound on the glue).
2. TTS first-audio latency while the local LLM generates, divided by the same when idle.
3. Per text mode (`text_modes`: `stream`, the tuned settings; `clause`, sentences with the first
   clause ahead), the reply's first words on one clock (`first_words.py`): LLM first token (as
   the agent got it) -> first audio at the agent's output and -> first audible (+ the reply's
   leading silence), the same from the reply's start (the later of that token and the turn's
   commit), the engine's own socket figure, and the stage-by-stage breakdown. With `--llm-pace`
   the LLM is a paced stand-in (`harness/openai_stand_in.py`: a fixed reply at a fixed rate, no
   CPU), so these isolate the pipeline.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import httpx
from livekit.agents import llm as lk_llm

from voice_agent.harness.demo import run_turns
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.lab.first_words import ReplyClock, TimedAgent, median_spans, spans_ms
from voice_agent.lab.turn_bench import PAUSED, baseline, turn_set, word_error_rate, words
from voice_agent.services import RANDOM_TTS, LocalService, ensure_llm, hub_model_available
from voice_agent.settings import Settings

COLUMNS = ("end_of_turn_s", "transcription_s", "llm_ttft_s", "llm_ttfs_s", "tts_ttfb_s", "voice_to_voice_s",
           "tts_first_chunk_compute_s", "added_s", "end_of_turn_delay_s", "transcription_delay_s",
           "vad_end_lag_s", "llm_first_token_to_audio_s")  # fmt: skip
TURN_SETTINGS = ("stt_streaming", "stt_encoder_context", "stt_final_silence", "vad_min_silence", "endpointing_min_delay", "endpointing_max_delay", "turn_detector",
                 "preemptive_generation", "preemptive_tts", "tts_first_clause_words", "tts_first_clause_chunk_frames", "tts_text_input")  # fmt: skip


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(xs: list[float]) -> dict:
    return {"p50": statistics.median(xs), "p95": _pct(xs, 0.95), "n": len(xs)} if xs else {}


async def _tts_first_audio(url: str, n: int, voice: str, i0: int = 0,
                           audible: list[float] | None = None) -> list[float]:  # fmt: skip
    """Seconds to the first chunk of `n` streamed requests; `audible` gets the seconds to the
    first audible sample of each (the first chunk + the audio's leading silence)."""
    from qwen3_tts_engine.audio import leading_silence_s  # the engine's extra, as below

    out = []
    async with httpx.AsyncClient(timeout=600) as c:
        for i in range(n):
            body = {"input": "How can I help you today?", "voice": voice, "seed": i0 + i,
                    "max_new_tokens": 4, "stream": True, "response_format": "pcm"}  # fmt: skip
            t0 = time.perf_counter()
            first = None
            pcm = bytearray()
            async with c.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
                r.raise_for_status()
                async for data in r.aiter_raw():
                    first = first if first is not None else time.perf_counter() - t0
                    pcm += data
            out.append(first)
            if audible is not None:
                rate = int(r.headers.get("X-Sample-Rate", 24000))
                audible.append(first + leading_silence_s(bytes(pcm[: len(pcm) // 2 * 2]), rate))
    return out


async def _llm_busy(llm_url: str, model: str, stop: asyncio.Event) -> int:
    """Keep the LLM generating (streamed completions, one after another) until `stop`."""
    n = 0
    async with httpx.AsyncClient(timeout=600) as c:
        while not stop.is_set():
            body = {"model": model, "stream": True, "max_tokens": 200, "temperature": 1.0,
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}  # fmt: skip
            async with c.stream("POST", f"{llm_url}/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    n += 1
                    if stop.is_set():
                        break
    return n


async def _recorded(handler, before: int, timeout: float = 60.0) -> None:
    """Until the engine has recorded a synthesis after the first `before`: it records one when its
    worker reports the end, which can come after the caller heard the last audio (a busy host).
    The timeout only guards against a hang (the row then has no chunk times)."""
    for _ in range(round(timeout / 0.02)):  # the handler has no event for it: polled
        if len(handler.history) > before:
            return
        await asyncio.sleep(0.02)


PACED_REPLY = ("Sure, the capital of France is Paris. It is known for its museums, its cafes "
               "and the Eiffel Tower. Is there anything else you would like to know?")  # fmt: skip


async def _timed_turn(settings: Settings, audio, tts_url: str, llm_url: str,
                      first_tokens_sent: list[float]) -> tuple:  # fmt: skip
    """One turn in a session of its own, with the reply's first words on one clock: (its
    TurnReport, the stage stamps, the engine's own socket first audio in s or None)."""
    clock, conversations = ReplyClock(), []

    def on_start(conversation) -> None:
        conversations.append(conversation)

        def on_item(ev) -> None:
            if isinstance(ev.item, lk_llm.ChatMessage) and ev.item.role == "user":
                clock.committed()

        conversation.session.on("conversation_item_added", on_item)

    (r,) = await run_turns(settings, [audio], tts_url=tts_url, llm_url=llm_url,
                           agent=TimedAgent(settings.instructions, clock), on_start=on_start)  # fmt: skip
    frames = conversations[0].audio_out.frames if conversations else []
    stamps = clock.reply_stamps(first_tokens_sent, frames[0][0] if frames else None)
    return r, stamps, clock.engine_first_audio_s()


def _first_words(r, stamps: dict, engine_s: float | None) -> dict:
    """A row's first-words columns (seconds) and its breakdown (ms)."""
    from qwen3_tts_engine.audio import leading_silence_s  # the engine's extra, as below

    out_t, token, start = (
        stamps["first_audio_out"],
        stamps["llm_first_token"],
        stamps["reply_start"],
    )
    audible = None
    if out_t is not None and r.reply_audio is not None and len(r.reply_audio):
        audible = out_t + leading_silence_s(r.reply_audio.tobytes(), 24000)
    gap = lambda a, b: None if a is None or b is None else b - a  # noqa: E731
    return {"llm_first_token_to_first_audio_s": gap(token, out_t),
            "llm_first_token_to_first_audible_s": gap(token, audible),
            "reply_start_to_first_audio_s": gap(start, out_t),
            "reply_start_to_first_audible_s": gap(start, audible),
            "commit_after_first_token_s": gap(token, stamps["turn_committed"]),
            "engine_socket_first_audio_s": engine_s,
            "first_words_ms": spans_ms(stamps)}  # fmt: skip


async def _turns(settings: Settings, turns, tts_url: str, llm_url: str, handler,
                 first_tokens_sent: list[float]) -> list[dict]:  # fmt: skip
    """Each spoken turn in a session of its own; one row per turn."""
    rows = []
    for turn in turns:
        before = len(handler.history)
        r, stamps, engine_s = await _timed_turn(settings, turn.audio, tts_url, llm_url,
                                                first_tokens_sent)  # fmt: skip
        if r.tts_requests and not r.silent:
            await _recorded(handler, before)
        syntheses = list(handler.history)[before:]
        chunks = syntheses[0]["chunk_compute_s"] if syntheses else None
        row = {"kind": turn.kind, "text": turn.text, "pause_s": turn.pause_s,
               "transcript": r.transcript, "user_messages": r.user_messages,
               # cut: a turn committed before the caller's last word, the utterance split in two, or
               # its transcript short of the words spoken (the rest never became this turn's)
               "ended_early": (r.early_commits > 0 or r.user_messages > 1
                               or len(words(r.transcript)) < 0.75 * len(words(turn.text))),
               "silent": r.silent,
               "end_of_turn_delay_s": r.end_of_turn_delay_s,
               "transcription_delay_s": r.transcription_delay_s, "llm_ttft_s": r.llm_ttft_s,
               "llm_ttfs_s": r.llm_ttfs_s, "tts_ttfb_s": r.tts_ttfb_s,
               "voice_to_voice_s": r.voice_to_voice_s, "vad_end_lag_s": r.vad_end_lag_s,
               "tts_first_chunk_compute_s": chunks[0] if chunks else None, "stt_s": r.stt_s,
               "llm_requests": r.llm_requests, "llm_wasted": r.llm_wasted,
               "tts_requests": r.tts_requests, "tts_wasted": r.tts_wasted,
               **_first_words(r, stamps, engine_s)}  # fmt: skip
        lag = r.vad_end_lag_s  # from the caller's last sample to LiveKit's end of speech
        for ours, livekit in (
            ("end_of_turn_s", "end_of_turn_delay_s"),
            ("transcription_s", "transcription_delay_s"),
        ):
            row[ours] = None if lag is None or row[livekit] is None else row[livekit] + lag
        # LiveKit's: ttfs - ttft = the LLM's first token -> the TTS got text (a clause, or the first
        # token itself when streamed); + ttfb = -> the TTS's first audio
        ttft, ttfs, ttfb = row["llm_ttft_s"], row["llm_ttfs_s"], row["tts_ttfb_s"]
        row["llm_first_token_to_audio_s"] = (
            None if None in (ttft, ttfs, ttfb) else ttfs - ttft + ttfb
        )
        llm_first = row["llm_ttfs_s"] if row["llm_ttfs_s"] is not None else row["llm_ttft_s"]
        parts = (row["end_of_turn_s"], llm_first, row["tts_first_chunk_compute_s"])
        if None in (*parts, row["voice_to_voice_s"]):
            row["added_s"] = None
        else:
            eot, llm_first, tts = parts
            # With preemptive generation the LLM (and the TTS, with preemptive TTS) may start at
            # the final transcript, before the turn is committed: at most (end of turn -
            # transcription delay) of their time is hidden. Counting only the rest as compute
            # bounds the glue from above.
            lead = (
                max(0.0, eot - (row["transcription_s"] or 0.0))
                if settings.preemptive_generation
                else 0.0
            )
            tts_early = settings.preemptive_generation and settings.preemptive_tts
            early, late = (
                (llm_first + tts, 0.0) if tts_early else (llm_first, tts)
            )  # before / after the commit
            row["added_s"] = row["voice_to_voice_s"] - eot - max(0.0, early - lead) - late
        rows.append(row)
    return rows


def _config_report(rows: list[dict]) -> dict:
    return {
        "turns": rows,
        "summary": {c: _summary([r[c] for r in rows if r[c] is not None]) for c in COLUMNS},
        "ended_early": {"plain": sum(r["ended_early"] for r in rows if r["kind"] == "plain"),
                        "paused": sum(r["ended_early"] for r in rows if r["kind"] == "paused")},
        "silent_turns": sum(r["silent"] for r in rows),
        # requests made for a reply that was not the one spoken (preemptive ones redone)
        "wasted_requests": {k: sum(r[f"{k}_wasted"] for r in rows) for k in ("llm", "tts")},
        "requests": {k: sum(r[f"{k}_requests"] for r in rows) for k in ("llm", "tts")},
    }  # fmt: skip


FIRST_WORDS = ("llm_first_token_to_first_audio_s", "llm_first_token_to_first_audible_s",
               "reply_start_to_first_audio_s", "reply_start_to_first_audible_s",
               "commit_after_first_token_s", "engine_socket_first_audio_s")  # fmt: skip


def _text_mode(rows: list[dict]) -> dict:
    """A text mode's first words: p50/p95 per column, how many replies the commit held (their
    LLM's first token came before the turn was committed), the breakdown's medians (ms)."""
    rows = [r for r in rows if not r["silent"]]
    out = {c: _summary([r[c] for r in rows if r[c] is not None]) for c in FIRST_WORDS}
    out["held_for_commit"] = sum((r["commit_after_first_token_s"] or 0) > 0 for r in rows)
    out["stages_median_ms"] = median_spans([r["first_words_ms"] for r in rows])
    return out


def _p50_over(a: dict, b: dict, column: str) -> float | None:
    x, y = a[column].get("p50"), b[column].get("p50")
    return None if x is None or not y else x / y


def _ratio(tuned: dict, base: dict, column: str) -> float | None:
    a, b = tuned["summary"][column].get("p50"), base["summary"][column].get("p50")
    return None if a is None or not b else a / b


async def _bench(
    settings: Settings,
    llm: LocalService | None,
    turns: int,
    paused_turns: int,
    tts_requests: int,
    pace: tuple[float, float] | None = None,
) -> dict:
    # optional extra: the engine package (`voice-agent[local]`), needed by this command only
    from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig

    model, notes = settings.tts_model, []
    if not hub_model_available(model, settings.offline):
        from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint  # (the same extra)

        model, notes = str(default_tiny_checkpoint()), [RANDOM_TTS]
    engine = EngineServer(
        Engine(model, [Handler(model, settings.tts_variant)]), ServerConfig(port=0)
    )
    await engine.start()
    handler = engine.engine.active
    tts_url = f"http://127.0.0.1:{engine.port}"
    stand_in = None
    if pace is not None:  # (tokens a second, first-token delay s): no local LLM
        stand_in = await ScriptedChatServer(PACED_REPLY, use_tool=False, keep_requests=False,
                                            pace=pace[0], first_token_s=pace[1]).start()  # fmt: skip
        llm = LocalService("llm", stand_in.url, model=stand_in.model)
        notes.append(f"the LLM is a paced stand-in: {pace[0]:g} tokens/s, first token after "
                     f"{pace[1] * 1000:g} ms, always the same reply")  # fmt: skip
    first_tokens_sent = stand_in.first_token_at if stand_in else []
    notes += list(llm.notes)
    if llm.model:
        settings = replace(settings, llm_model=llm.model)
    if notes:  # random models: bound the replies
        settings = replace(settings, llm_max_tokens=min(settings.llm_max_tokens, 12),
                           llm_temperature=settings.llm_temperature or 1.0,
                           tts_max_new_tokens=settings.tts_max_new_tokens or 4)  # fmt: skip
    # tuned: as configured (TTS_TEXT_INPUT auto streams the reply's text to this engine); clause:
    # the same, but sentences with the first clause ahead (the TTS path before streamed text)
    configs = {"tuned": settings, "clause": replace(settings, tts_text_input="sentences"),
               "baseline": baseline(settings)}  # fmt: skip
    try:
        spoken = turn_set(turns, paused_turns)
        reports = {}
        for name, config in configs.items():
            print(f"voice-agent bench: {len(spoken)} turns, {name} settings ...", file=sys.stderr)
            rows = await _turns(config, spoken, tts_url, llm.url, handler, first_tokens_sent)
            reports[name] = _config_report(rows)
        voice = (handler.info.get("voices") or [None])[0]
        idle_audible: list[float] = []
        busy_audible: list[float] = []
        idle = await _tts_first_audio(tts_url, tts_requests, voice, audible=idle_audible)
        stop = asyncio.Event()
        busy_task = asyncio.create_task(_llm_busy(llm.url, settings.llm_model, stop))
        await asyncio.sleep(1.0)  # the LLM is generating
        busy = await _tts_first_audio(tts_url, tts_requests, voice, i0=100, audible=busy_audible)
        stop.set()
        lines = await busy_task
    finally:
        await engine.stop()
        if stand_in is not None:
            await stand_in.stop()
    tuned, base, clause = reports["tuned"], reports["baseline"], reports["clause"]
    plain = [(a["transcript"], b["transcript"]) for a, b in zip(tuned["turns"], base["turns"], strict=True)
             if a["kind"] == "plain"]  # fmt: skip
    wers = [word_error_rate(b, a) for a, b in plain if b]
    modes = {"stream": _text_mode(tuned["turns"]), "clause": _text_mode(clause["turns"])}
    return {
        "text_modes": modes,
        "text_modes_stream_over_clause_p50": {
            c: _p50_over(modes["stream"], modes["clause"], c)
            for c in ("llm_first_token_to_first_audio_s", "reply_start_to_first_audio_s")},
        "llm_pace": None if pace is None else {"tokens_per_s": pace[0], "first_token_s": pace[1]},
        "notes": notes,
        "settings": {name: {k: asdict(c)[k] for k in TURN_SETTINGS} for name, c in configs.items()},
        "paused_set": [{"before": b, "pause_s": p, "after": a} for b, p, a in PAUSED[:paused_turns]],
        "tuned": tuned, "clause": clause, "baseline": base,
        "ratios": {"end_of_turn_p50": _ratio(tuned, base, "end_of_turn_s"),
                   "transcription_p50": _ratio(tuned, base, "transcription_s"),
                   "voice_to_voice_p50": _ratio(tuned, base, "voice_to_voice_s"),
                   "livekit_end_of_turn_delay_p50": _ratio(tuned, base, "end_of_turn_delay_s")},
        # streamed text (tuned, with TTS_TEXT_INPUT auto or stream) over clause mode, same turns and seeds
        "streaming_vs_clause": {
            "llm_first_token_to_audio_p50": _ratio(tuned, clause, "llm_first_token_to_audio_s"),
            "voice_to_voice_p50": _ratio(tuned, clause, "voice_to_voice_s"),
            "ended_early": {"tuned": tuned["ended_early"], "clause": clause["ended_early"]},
            "text_streamed": settings.tts_text_input != "sentences"},
        "plain_transcript_wer_vs_baseline": statistics.mean(wers) if wers else None,
        "goals": {"end_of_turn_p50_ratio": 0.5, "streaming_vs_clause_first_token_to_audio": 0.5,
                  "streaming_vs_clause_voice_to_voice": "below 1, no more cut turns", "voice_to_voice_p50_ratio": 0.7,
                  "ended_early": "no more than the baseline", "added_p95_s": 0.060,
                  "plain_transcript_wer": 0.05},
        "added_latency_s": tuned["summary"]["added_s"],
        "tts_first_audio_idle_s": _summary(idle), "tts_first_audio_llm_busy_s": _summary(busy),
        # + the leading silence inside the audio: the first sample a listener hears (Coval's)
        "tts_first_audible_idle_s": _summary(idle_audible),
        "tts_first_audible_llm_busy_s": _summary(busy_audible),
        "llm_stream_lines_during_busy": lines,
        "contention_ratio": statistics.median(busy) / statistics.median(idle), "goal_ratio": 1.3,
    }  # fmt: skip


def run_bench(
    settings: Settings,
    turns: int,
    paused_turns: int,
    tts_requests: int,
    out: Path | None,
    pace: tuple[float, float] | None = None,
) -> int:
    # The LLM service on the main thread, before the event loop (as the demo does): offline it
    # writes the tiny random LLM with mlx, and mlx used on a worker thread (asyncio.to_thread)
    # made the process abort at interpreter exit now and then ("terminate called without an
    # active exception", exit -6, after the report was printed).
    llm = ensure_llm(settings) if pace is None else None  # paced: a stand-in, in _bench
    try:
        report = asyncio.run(_bench(settings, llm, turns, paused_turns, tts_requests, pace))
    finally:
        if llm is not None:
            llm.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text)
    return 0
