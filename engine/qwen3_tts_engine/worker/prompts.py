"""The talker's prompt for one text, in either of the reference code's two layouts.

Qwen3-TTS (QwenLM/Qwen3-TTS, `Qwen3TTSForConditionalGeneration.generate`) sums two tracks per
position: a text term `text_projection(text_embedding(id))` and a codec term (a codec-table row,
the speaker embedding or a reference frame). `non_streaming_mode` picks the layout:

- "prompt" (non-streaming): the whole text sits in the prompt over `codec_pad`, then `tts_eos`,
  then `tts_pad` over `codec_bos`; every step after it adds `tts_pad` ("trailing text" = pad).
- "dual" (dual-track): the prompt ends with the first text token over `codec_bos`; step g adds
  the text token g + 1 to the frame's codec embeddings, then `tts_eos`, then `tts_pad`. Text can
  arrive while speech is made: the prompt needs only the first token.

`layout()` says position by position which ids are summed (pure, tested against the reference's
table); `build_prompt()` turns a layout into embeddings. The "prompt" layout of a plain request
is built by mlx-audio's own `_prepare_generation_inputs` (what the engine always ran; the tests
check that `layout()` gives the same embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from qwen3_tts_engine.protocol import TEXT_MODES, SpeechRequest
from qwen3_tts_engine.rules import Voice
from qwen3_tts_engine.worker.incremental_text import chat_text


@dataclass(frozen=True)
class Row:
    """One prompt position: a text-track id plus at most one codec term."""

    text: int
    codec: int | None = None  # a row of the talker's codec table
    speaker: bool = False  # the speaker embedding (preset speaker or x-vector)
    ref_frame: int | None = None  # in-context cloning: reference frame k (its 16 codebooks summed)


@dataclass(frozen=True)
class Ids:
    """The control ids a layout uses (config.json of the checkpoint)."""

    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_pad: int
    codec_bos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int

    @classmethod
    def of(cls, model) -> Ids:
        c, t = model.config, model.config.talker_config
        return cls(c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id, t.codec_pad_id,
                   t.codec_bos_id, t.codec_think_id, t.codec_nothink_id, t.codec_think_bos_id,
                   t.codec_think_eos_id)  # fmt: skip


@dataclass
class Layout:
    rows: list[Row]
    trailing: list[int] = field(default_factory=list)  # text ids fed one per step, then tts_pad
    eos_in_prompt: bool = False  # tts_eos is already in the prompt (nothing to withhold)


def layout(ids: Ids, *, mode: str, role: list[int], text: list[int], text_ended: bool = True,
           language_id: int | None = None, speaker: bool = False, instruct: list[int] | None = None,
           ref_text: list[int] | None = None, ref_frames: int = 0) -> Layout:  # fmt: skip
    """The reference code's prompt for `text` (its ids, `text_token_ids`), position by position.

    `role`: the 3 ids of `<|im_start|>assistant\\n`; `instruct`: the ids of
    `<|im_start|>user\\n{instruct}<|im_end|>\\n`; `ref_text`/`ref_frames`: in-context cloning.
    `text_ended=False` (dual only): more text follows, so `tts_eos` is not in the trailing text yet.
    """
    if mode not in TEXT_MODES:
        raise ValueError(f"text mode must be one of {TEXT_MODES}, got {mode!r}")
    if not text_ended and (mode != "dual" or ref_text is not None):
        raise ValueError("only the dual-track layout without in-context cloning takes open text")
    if not text:
        raise ValueError("a prompt needs at least one text token")
    rows = [Row(i) for i in instruct or []] + [Row(i) for i in role]
    prefix = [ids.nothink, ids.think_bos, ids.think_eos] if language_id is None else [
        ids.think, ids.think_bos, language_id, ids.think_eos]  # fmt: skip
    codec = [Row(ids.tts_pad, codec=c) for c in prefix]
    if speaker:
        codec.append(Row(ids.tts_pad, speaker=True))
    rows += codec + [Row(ids.tts_bos, codec=ids.codec_pad)]
    if ref_text is not None:  # in-context cloning (`generate_icl_prompt`)
        track = [*ref_text, *text, ids.tts_eos]
        frames = [Row(0, codec=ids.codec_bos)] + [Row(0, ref_frame=k) for k in range(ref_frames)]
        if mode == "prompt":
            rows += [Row(t, codec=ids.codec_pad) for t in track]
            rows += [Row(ids.tts_pad, codec=f.codec, ref_frame=f.ref_frame) for f in frames]
            return Layout(rows, eos_in_prompt=True)
        n = len(frames)
        padded = track[:n] + [ids.tts_pad] * (n - len(track))
        rows += [
            Row(t, codec=f.codec, ref_frame=f.ref_frame)
            for t, f in zip(padded, frames, strict=True)
        ]
        return Layout(rows, trailing=track[n:], eos_in_prompt=len(track) <= n)
    if mode == "prompt":
        rows += [Row(t, codec=ids.codec_pad) for t in [*text, ids.tts_eos]]
        rows.append(Row(ids.tts_pad, codec=ids.codec_bos))
        return Layout(rows, eos_in_prompt=True)
    rows.append(Row(text[0], codec=ids.codec_bos))
    return Layout(rows, trailing=[*text[1:], *([ids.tts_eos] if text_ended else [])])


def language_id(model, language: str, speaker: str | None) -> int | None:
    """The codec's language id (None: "auto"), a dialect speaker's own for Chinese or auto."""
    config = model.config.talker_config
    ids = config.codec_language_id or {}
    lang = language.lower()
    found = ids.get(lang) if lang != "auto" else None
    dialect = (config.spk_is_dialect or {}).get(speaker.lower()) if speaker else None
    if lang in ("chinese", "auto") and dialect and dialect in ids:
        found = ids[dialect]
    return found


def text_embeddings(model, token_ids: list[int]) -> mx.array:
    """The text track's terms [1, n, H] for `token_ids`."""
    talker = model.talker
    return talker.text_projection(talker.get_text_embeddings()(mx.array([token_ids])))


def embed(model, lay: Layout, *, speaker: mx.array | None = None,
          ref_codes: mx.array | None = None) -> mx.array:  # fmt: skip
    """The prompt embeddings [1, L, H] of a layout (text term + codec term per row)."""
    talker = model.talker
    text = text_embeddings(model, [r.text for r in lay.rows])
    codec_table = talker.get_input_embeddings()
    terms = []
    for r in lay.rows:
        if r.codec is not None:
            terms.append(codec_table(mx.array([[r.codec]])))
        elif r.speaker:
            terms.append(speaker.reshape(1, 1, -1).astype(text.dtype))
        elif r.ref_frame is not None:
            frame = ref_codes[:, :, r.ref_frame : r.ref_frame + 1]  # [1, 16, 1]
            term = codec_table(frame[:, 0])
            for i, table in enumerate(talker.code_predictor.codec_embedding):
                term = term + table(frame[:, i + 1])
            terms.append(term)
        else:
            terms.append(mx.zeros((1, 1, text.shape[-1]), text.dtype))
    return text + mx.concatenate(terms, axis=1).astype(text.dtype)


@dataclass
class Prompt:
    """What a stream starts from: the prompt, the trailing text so far and the pad term."""

    embeds: mx.array  # [1, L, H]
    trailing: mx.array | None  # [1, T, H] (None: nothing but pad follows)
    pad: mx.array  # [1, 1, H]
    trailing_ids: list[int]
    eos_in_prompt: bool


def build_prompt(model, req: SpeechRequest, voice: Voice, ref_audio: mx.array | None, *,
                 mode: str, text: list[int], role: list[int],
                 text_ended: bool = True, source_text: str | None = None) -> Prompt:  # fmt: skip
    """The prompt of a request's text (its ids `text`, after the 3 `role` ids) in `mode`;
    in-context cloning when the request brings reference audio and its transcript (Base)."""
    icl = ref_audio is not None and bool(req.ref_text) and model.config.tts_model_type == "base"
    pad = text_embeddings(model, [model.config.tts_pad_token_id])
    if mode == "prompt" and source_text is not None:  # mlx-audio's own builder, as always
        if icl:
            embeds, _t, _p, _codes = model._prepare_icl_generation_inputs(
                text=source_text, ref_audio=ref_audio, ref_text=req.ref_text, language=req.language
            )
        else:
            embeds, _t, _p = model._prepare_generation_inputs(
                text=source_text, language=req.language, speaker=voice.speaker,
                ref_audio=ref_audio, instruct=voice.instruct)  # fmt: skip
        return Prompt(embeds, None, pad, [], True)
    speaker = None
    if ref_audio is not None and model.speaker_encoder is not None:
        speaker = model.extract_speaker_embedding(ref_audio)
    elif voice.speaker and voice.speaker in (model.config.talker_config.spk_id or {}):
        speaker = model.talker.get_input_embeddings()(
            mx.array([[model.config.talker_config.spk_id[voice.speaker]]])
        )
    instruct = None
    if voice.instruct and not icl:
        instruct = list(model.tokenizer.encode(f"<|im_start|>user\n{voice.instruct}<|im_end|>\n"))
    ref_text_ids, ref_codes = (_icl_reference(model, ref_audio, req.ref_text) if icl
                               else (None, None))  # fmt: skip
    lay = layout(Ids.of(model), mode=mode, role=role, text=text, text_ended=text_ended,
                 language_id=language_id(model, req.language, None if icl else voice.speaker),
                 speaker=speaker is not None, instruct=instruct, ref_text=ref_text_ids,
                 ref_frames=0 if ref_codes is None else ref_codes.shape[-1])  # fmt: skip
    embeds = embed(model, lay, speaker=speaker, ref_codes=ref_codes)
    trailing = text_embeddings(model, lay.trailing) if lay.trailing else None
    return Prompt(embeds, trailing, pad, lay.trailing, lay.eos_in_prompt)


def _icl_reference(model, ref_audio: mx.array, ref_text: str) -> tuple[list[int], mx.array]:
    """The reference transcript's ids (`[3:-2]` of its assistant turn) and the reference audio's
    codes [1, 16, frames], cached on the model as mlx-audio caches them."""
    key = (ref_text, (ref_audio.size, float(ref_audio.sum())))
    if key in model._icl_cache:
        codes, ids = model._icl_cache[key]
    else:
        audio = ref_audio[None, None, :] if ref_audio.ndim == 1 else ref_audio[None, :]
        codes = model.speech_tokenizer.encode(audio)
        ids = mx.array(model.tokenizer.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n"))[
            None, 3:-2
        ]
        mx.eval(codes, ids)
        model._icl_cache[key] = (codes, ids)
    return [int(i) for i in ids[0].tolist()], codes


def role_ids(model, text: str) -> list[int]:
    """The 3 role ids the reference takes from the chat text (`input_id[:, :3]`)."""
    return list(model.tokenizer.encode(chat_text(text)))[:3]
