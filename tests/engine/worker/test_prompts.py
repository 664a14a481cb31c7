"""The talker's prompt in both layouts, against the reference code (QwenLM/Qwen3-TTS at 022e286).

Two checks: `layout()` position by position against the reference's table (which ids sit on
which track, written out here from `Qwen3TTSForConditionalGeneration.generate` and
`generate_icl_prompt`), and `build_prompt()`'s embeddings against a line-by-line transcription of
that torch code into mlx, on the tiny checkpoints (every kind: preset speaker, dialect,
instruction, x-vector and in-context cloning).
"""

import mlx.core as mx
import numpy as np
import pytest

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.rules import ModelInfo, check_request
from qwen3_tts_engine.worker.incremental_text import chat_text, text_token_ids
from qwen3_tts_engine.worker.loading import describe, load
from qwen3_tts_engine.worker.prompts import Ids, Row, build_prompt, layout, role_ids

IDS = Ids(tts_bos=1, tts_eos=2, tts_pad=3, codec_pad=10, codec_bos=11, think=12, nothink=13,
          think_bos=14, think_eos=15)  # fmt: skip
ROLE = [100, 101, 102]
TEXT = [200, 201, 202, 203]


def test_dual_track_layout_with_speaker_and_language():
    lay = layout(IDS, mode="dual", role=ROLE, text=TEXT, language_id=50, speaker=True)
    assert lay.rows == [
        Row(100), Row(101), Row(102),  # <|im_start|> assistant \n: text only
        Row(3, codec=12), Row(3, codec=14), Row(3, codec=50), Row(3, codec=15),  # think, lang
        Row(3, speaker=True),  # tts_pad + speaker
        Row(1, codec=10),  # tts_bos + codec_pad
        Row(200, codec=11),  # the first text token + codec_bos: the last prompt row
    ]  # fmt: skip
    assert lay.trailing == [201, 202, 203, 2]  # the rest of the text, then tts_eos
    assert not lay.eos_in_prompt


def test_non_streaming_layout_holds_the_whole_text():
    lay = layout(IDS, mode="prompt", role=ROLE, text=TEXT, language_id=None, speaker=False)
    assert lay.rows == [
        Row(100), Row(101), Row(102),
        Row(3, codec=13), Row(3, codec=14), Row(3, codec=15),  # auto: nothink, no language row
        Row(1, codec=10),
        Row(200, codec=10), Row(201, codec=10), Row(202, codec=10), Row(203, codec=10),
        Row(2, codec=10),  # tts_eos + codec_pad
        Row(3, codec=11),  # tts_pad + codec_bos
    ]  # fmt: skip
    assert lay.trailing == [] and lay.eos_in_prompt


def test_instruction_rows_come_first_in_both_layouts():
    for mode in ("prompt", "dual"):
        lay = layout(IDS, mode=mode, role=ROLE, text=TEXT, instruct=[300, 301])
        assert lay.rows[:5] == [Row(300), Row(301), Row(100), Row(101), Row(102)]


def test_open_text_has_no_tts_eos_yet():
    lay = layout(IDS, mode="dual", role=ROLE, text=TEXT[:2], text_ended=False)
    assert lay.rows[-1] == Row(200, codec=11) and lay.trailing == [201]
    with pytest.raises(ValueError):
        layout(IDS, mode="prompt", role=ROLE, text=TEXT, text_ended=False)


@pytest.mark.parametrize("frames", [2, 8])
def test_in_context_cloning_layouts(frames):
    ref = [400, 401]
    track = [*ref, *TEXT, 2]  # reference text, target text, tts_eos: 7 positions
    lay = layout(
        IDS, mode="prompt", role=ROLE, text=TEXT, speaker=True, ref_text=ref, ref_frames=frames
    )
    icl = lay.rows[8:]
    assert icl[: len(track)] == [Row(t, codec=10) for t in track]
    assert icl[len(track) :] == [Row(3, codec=11)] + [Row(3, ref_frame=k) for k in range(frames)]
    lay = layout(
        IDS, mode="dual", role=ROLE, text=TEXT, speaker=True, ref_text=ref, ref_frames=frames
    )
    codec = [Row(0, codec=11)] + [Row(0, ref_frame=k) for k in range(frames)]
    n = frames + 1
    texts = track[:n] + [3] * (n - len(track))  # text over the reference frames, pad past it
    assert lay.rows[8:] == [
        Row(t, codec=c.codec, ref_frame=c.ref_frame) for t, c in zip(texts, codec, strict=True)
    ]
    assert lay.trailing == track[n:] and lay.eos_in_prompt == (len(track) <= n)


# -- embeddings: build_prompt against a transcription of the reference's torch code ----------


def _reference_prompt(model, text: str, *, language: str, speaker: str | None,
                      instruct: str | None, non_streaming: bool, spk_embed=None,
                      ref_text: str | None = None, ref_code=None):  # fmt: skip
    """`Qwen3TTSForConditionalGeneration.generate`'s prompt and trailing text for one request,
    transcribed into mlx (modeling_qwen3_tts.py: the loop over input_ids and
    generate_icl_prompt)."""
    talker, cfg, tc = model.talker, model.config, model.config.talker_config
    tok = model.tokenizer

    def text_proj(ids):
        return talker.text_projection(talker.get_text_embeddings()(mx.array([ids])))

    def codec(ids):
        return talker.get_input_embeddings()(mx.array([ids]))

    input_id = list(tok.encode(chat_text(text)))
    parts = []
    if instruct:
        parts.append(text_proj(list(tok.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n"))))
    speaker_embed = spk_embed
    if speaker_embed is None and speaker:
        speaker_embed = codec([tc.spk_id[speaker]])
    language_id = None if language == "auto" else tc.codec_language_id[language]
    if language in ("chinese", "auto") and speaker and tc.spk_is_dialect[speaker]:
        language_id = tc.codec_language_id[tc.spk_is_dialect[speaker]]
    special = text_proj([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
    bos, eos, pad = special[:, 0:1], special[:, 1:2], special[:, 2:3]
    if language_id is None:
        prefill = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    else:
        prefill = [tc.codec_think_id, tc.codec_think_bos_id, language_id, tc.codec_think_eos_id]
    c0, c1 = codec(prefill), codec([tc.codec_pad_id, tc.codec_bos_id])
    ce = mx.concatenate([c0, c1] if speaker_embed is None
                        else [c0, speaker_embed.reshape(1, 1, -1), c1], axis=1)  # fmt: skip
    role = text_proj(input_id[:3])
    n = ce.shape[1] - 2
    body = mx.concatenate([mx.broadcast_to(pad, (1, n, pad.shape[-1])), bos], axis=1) + ce[:, :-1]
    embed = mx.concatenate([*parts, role, body], axis=1)  # the instruction first
    if ref_code is not None:
        ref_id = list(tok.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n"))[3:-2]
        te = mx.concatenate([text_proj(ref_id + input_id[3:-5]), eos], axis=1)
        ref_codec = talker.get_input_embeddings()(ref_code[:, 0, :])
        for i in range(tc.num_code_groups - 1):
            ref_codec = ref_codec + talker.code_predictor.codec_embedding[i](ref_code[:, i + 1, :])
        cc = mx.concatenate([codec([tc.codec_bos_id]), ref_codec], axis=1)
        tl, cl = te.shape[1], cc.shape[1]
        if non_streaming:
            icl = mx.concatenate([te + codec([tc.codec_pad_id] * tl), cc + pad], axis=1)
            trailing = pad
        elif tl > cl:
            icl, trailing = te[:, :cl] + cc, te[:, cl:]
        else:
            icl = mx.concatenate([te] + [pad] * (cl - tl), axis=1) + cc
            trailing = pad
        return mx.concatenate([embed, icl], axis=1), trailing
    embed = mx.concatenate([embed, text_proj(input_id[3:4]) + ce[:, -1:]], axis=1)
    if non_streaming:
        body = mx.concatenate([text_proj(input_id[3:-5]), eos], axis=1)
        body = body + codec([tc.codec_pad_id] * (len(input_id[3:-5]) + 1))
        embed = mx.concatenate([embed[:, :-1], body, pad + codec([tc.codec_bos_id])], axis=1)
        return embed, pad
    return embed, mx.concatenate([text_proj(input_id[4:-5]), eos], axis=1)


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    out = {}
    for kind in ("custom_voice", "voice_design", "base"):
        out[kind], _ = load(resolve(str(tiny_checkpoint(kind))), progress=False)
    return out


def _ours(model, req: SpeechRequest, mode: str, ref_audio=None):
    voice = check_request(
        req, ModelInfo.from_info(describe(model)), ref_audio=ref_audio is not None
    )
    ids = text_token_ids(model.tokenizer, req.input)
    p = build_prompt(model, req, voice, ref_audio, mode=mode, text=ids,
                     role=role_ids(model, req.input))  # fmt: skip
    return voice, p


def _close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


CASES = [
    ("custom_voice", dict(voice="ryan", language="english")),
    ("custom_voice", dict(voice="ryan", language="auto")),
    ("custom_voice", dict(voice="eric", language="chinese")),  # a dialect speaker
    ("custom_voice", dict(voice="vivian", language="german")),
    ("voice_design", dict(instructions="A calm, low voice.", language="english")),
]


@pytest.mark.parametrize("mode", ["dual", "prompt"])
@pytest.mark.parametrize(
    ("kind", "fields"), CASES, ids=[f"{k}-{f.get('voice')}-{f['language']}" for k, f in CASES]
)
def test_prompt_embeddings_equal_the_reference(models, kind, fields, mode):
    model = models[kind]
    for text in ("Hello there, how are you?", "\nA text that starts with a newline.", "Hi"):
        req = SpeechRequest(input=text, **fields)
        voice, ours = _ours(model, req, mode)
        ref, trailing = _reference_prompt(model, text, language=req.language, speaker=voice.speaker,
                                          instruct=voice.instruct, non_streaming=mode == "prompt")  # fmt: skip
        _close(ours.embeds, ref)
        if mode == "dual":
            _close(ours.trailing, trailing)
            assert ours.trailing_ids[-1] == model.config.tts_eos_token_id
        else:
            assert ours.trailing is None and ours.eos_in_prompt
            _close(ours.pad, trailing)  # the reference's trailing text is one tts_pad
        # the "prompt" layout as mlx-audio builds it (what the engine has always run)
        mlx_audio, _t, _p = model._prepare_generation_inputs(
            text=text, language=req.language, speaker=voice.speaker, instruct=voice.instruct
        )
        if mode == "prompt":
            _close(mlx_audio, ref)


def _sine(seconds: float) -> mx.array:
    t = np.arange(int(24000 * seconds)) / 24000
    return mx.array((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32))


@pytest.mark.parametrize("mode", ["dual", "prompt"])
@pytest.mark.parametrize(("ref_text", "seconds"), [
    (None, 0.4), ("Ref.", 2.5), ("A much longer reference transcript than its audio.", 0.4)])  # fmt: skip
def test_base_prompts_equal_the_reference(models, mode, ref_text, seconds):
    """x-vector (ref_audio alone) and in-context cloning; the text track shorter and longer
    than the reference's frames (the two branches of the reference's dual-track ICL)."""
    model = models["base"]
    audio = _sine(seconds)
    req = SpeechRequest(input="Cloned voice speaking.", ref_text=ref_text, language="english")
    _voice, ours = _ours(model, req, mode, ref_audio=audio)
    # generate_speaker_prompt: the x-vector in the talker's dtype
    spk = model.extract_speaker_embedding(audio).astype(
        model.talker.get_input_embeddings().weight.dtype
    )
    ref_code = model.speech_tokenizer.encode(audio[None, None, :]) if ref_text else None
    ref, trailing = _reference_prompt(model, req.input, language="english", speaker=None,
                                      instruct=None, non_streaming=mode == "prompt",
                                      spk_embed=spk, ref_text=ref_text, ref_code=ref_code)  # fmt: skip
    _close(ours.embeds, ref)
    if ours.trailing is not None:
        _close(ours.trailing, trailing)
    else:
        _close(ours.pad, trailing)
    if ref_text and mode == "dual":  # both branches of the reference's dual-track ICL run
        assert (ours.trailing is None) == (seconds > 1)
