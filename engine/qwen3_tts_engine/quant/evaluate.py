"""`qwen3-tts eval`: candidates against a full-precision reference on the same texts and seeds.

The reference generates codes once per (text, seed); every candidate is then teacher-forced along
those codes (KL, top-1, EOS drift), run free from the same seed (length, runaway, divergence), and,
for the first `audio_items` items, decoded to audio (silence, CER, decoder distances). Each metric
is a mean over items with a bootstrap interval; the noise floor is the reference against itself
run from other seeds.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from qwen3_tts_engine.governor.budget import DEFAULT_BUDGET, SCHEMA, evaluate_budget
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.checkpoints import source_digest
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.quant.audio_metrics import (
    character_error_rate,
    log_mel_distance,
    mrstft_distance,
    speech_fraction,
    transcribe,
)
from qwen3_tts_engine.quant.candidates import Candidate, build, load_dir, weight_bytes
from qwen3_tts_engine.quant.forced import Forced, compare_forced, teacher_forced
from qwen3_tts_engine.quant.free_running import compare_runs, generate_codes_batched
from qwen3_tts_engine.quant.stats import bootstrap_ci, paired_bootstrap
from qwen3_tts_engine.quant.texts import CALIBRATION_TEXTS, EVAL_TEXTS
from qwen3_tts_engine.worker.synthesis import one_shot_decode

SILENT_BELOW = 0.2  # an utterance is "silent" when Silero hears speech in less than this fraction
TEACHER_FORCED = ("cb0_kl", "cb0_top1", "cp_kl", "cp_top1", "eos_drift")


@dataclass
class EvalSettings:
    texts: tuple[str, ...] = EVAL_TEXTS
    seeds: tuple[int, ...] = (0, 1)
    max_new_tokens: int | None = None  # None: the engine's default cap for each text
    voice: str | None = None  # None: the model's first voice (CustomVoice) or none
    language: str = "auto"
    instructions: str | None = None  # the voice description a VoiceDesign checkpoint needs
    audio_items: int = 0  # items decoded to audio (the vocoder dominates the cost)
    noise_seed_offset: int = 1000
    calibration_texts: tuple[str, ...] = CALIBRATION_TEXTS
    # GPTQ needs many more calibration frames than an evaluation needs items: 96 frames made it
    # worse than round-to-nearest on a tiny checkpoint, ~1000 better (docs/benchmarks.md: Quantization quality).
    calibration_frames: int | None = None  # None: the engine's default cap for each text
    budget: dict = field(default_factory=lambda: dict(DEFAULT_BUDGET))
    n_boot: int = 2000

    def request(self, model, text: str, seed: int) -> SpeechRequest:
        voice = self.voice
        speakers = sorted((model.config.talker_config.spk_id or {}).keys())
        if voice is None and model.config.tts_model_type == "custom_voice" and speakers:
            voice = speakers[0]
        return SpeechRequest(input=text, voice=voice, language=self.language, seed=seed,
                             max_new_tokens=self.max_new_tokens, instructions=self.instructions)  # fmt: skip


@dataclass
class Item:
    req: SpeechRequest
    codes: np.ndarray
    hit_cap: bool
    forced: Forced
    audio: np.ndarray | None = None


class Reference:
    """The reference model's codes, distributions and (some) audio for every (text, seed)."""

    def __init__(
        self, path: Path, settings: EvalSettings, *, progress: Callable[[str], None] = logger.info
    ):
        self.path = Path(path)
        self.settings = settings
        self.model = load_dir(self.path)
        self.sample_rate = self.model.sample_rate
        self.items: list[Item] = []
        t0 = time.perf_counter()
        reqs = [
            settings.request(self.model, text, seed)
            for text in settings.texts
            for seed in settings.seeds
        ]
        for req, (codes, cap) in zip(reqs, generate_codes_batched(self.model, reqs), strict=True):
            self.items.append(Item(req, codes, cap, teacher_forced(self.model, req, codes)))
        for item in self.items[: settings.audio_items]:
            item.audio = decode(self.model, item.codes)
        progress(f"reference: {len(self.items)} items, {sum(len(i.codes) for i in self.items)} "
                 f"frames in {time.perf_counter() - t0:.1f}s")  # fmt: skip
        self.weight_bytes = weight_bytes(self.model)
        self._calibration: list[tuple[SpeechRequest, np.ndarray]] | None = None
        self._noise: dict | None = None

    def sampling_options(self) -> dict:
        """The sampler settings every free run used (the model's generation defaults)."""
        req = self.settings.request(self.model, "x", 0)
        options = self.model._resolve_generation_options(
            req.temperature, None, req.top_k, req.top_p, req.repetition_penalty
        )
        return {k: options[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty")}

    def calibration(self) -> list[tuple[SpeechRequest, np.ndarray]]:
        """(request, codes) the reference generates for the calibration texts (GPTQ)."""
        if self._calibration is None:
            reqs = [replace(self.settings.request(self.model, text, 10_000 + i),
                            max_new_tokens=self.settings.calibration_frames)
                    for i, text in enumerate(self.settings.calibration_texts)]  # fmt: skip
            runs = generate_codes_batched(self.model, reqs)
            self._calibration = [(req, codes) for req, (codes, _) in zip(reqs, runs, strict=True)]
        return self._calibration

    def calibrate(self, model) -> None:
        """Forward passes along the calibration codes (GPTQ records each layer's inputs)."""

        for req, codes in self.calibration():
            out = teacher_forced(model, req, codes)
            mx.eval(mx.array(out.cb0[:1]))

    def measure(self, model, *, decoder_identical: bool | None = None) -> dict[str, list]:
        """Per-item metrics of `model` against the reference."""
        if decoder_identical is None:
            decoder_identical = same_decoder(self.model, model)
        per_item: dict[str, list] = {}
        runs = generate_codes_batched(model, [item.req for item in self.items])
        for k, (item, (codes, cap)) in enumerate(zip(self.items, runs, strict=True)):
            row = compare_forced(item.forced, teacher_forced(model, item.req, item.codes))
            row.update(compare_runs(item.codes, codes, cap, item.hit_cap))
            if item.audio is not None:
                row.update(audio_metrics(model, item, codes, decoder_identical, self.sample_rate))
            for key, value in row.items():
                per_item.setdefault(key, []).append(value)
            logger.debug("item %d: %s", k, row)
        return per_item

    def noise_summary(self) -> dict:
        """Summaries of the noise floor (computed once per reference)."""
        if self._noise is None:
            self._noise, _ = summarize(self.noise_floor(), self.settings.n_boot)
            for name in TEACHER_FORCED:  # forced along its own codes: zero by construction
                self._noise[name] = {"mean": 1.0 if name.endswith("top1") else 0.0, "ci": None,
                                     "n": len(self.items), "note": "by construction"}  # fmt: skip
        return self._noise

    def noise_floor(self) -> dict[str, list]:
        """The reference against itself from other seeds: free-running and audio metrics."""
        per_item: dict[str, list] = {}
        reqs = [
            replace(item.req, seed=item.req.seed + self.settings.noise_seed_offset)
            for item in self.items
        ]
        runs = generate_codes_batched(self.model, reqs)
        for item, (codes, cap) in zip(self.items, runs, strict=True):
            row = compare_runs(item.codes, codes, cap, item.hit_cap)
            if item.audio is not None:
                row.update(_free_audio(decode(self.model, codes), item.req.input, self.sample_rate))
            for key, value in row.items():
                per_item.setdefault(key, []).append(value)
        return per_item


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("mlx", "mlx-audio", "numpy", "faster-whisper", "qwen3-tts-engine"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def decode(model, codes: np.ndarray) -> np.ndarray:

    return one_shot_decode(model, codes) if len(codes) else np.zeros(0, np.float32)


def same_decoder(a, b) -> bool:
    """True when both models' vocoders have bit-identical weights (recipes never touch it)."""

    pa = dict(tree_flatten(a.speech_tokenizer.parameters()))
    pb = dict(tree_flatten(b.speech_tokenizer.parameters()))
    return pa.keys() == pb.keys() and all(mx.array_equal(pa[k], pb[k]).item() for k in pa)


def _free_audio(audio: np.ndarray, text: str, rate: int) -> dict:

    silent = len(audio) == 0 or speech_fraction(audio, rate) < SILENT_BELOW
    return {"silence_rate": float(silent),
            "cer": 1.0 if len(audio) == 0 else character_error_rate(text, transcribe(audio, rate))}  # fmt: skip


def audio_metrics(model, item: Item, codes: np.ndarray, decoder_identical: bool, rate: int) -> dict:
    """Silence and CER of the candidate's own run; decoder distances on the reference's codes."""

    row = _free_audio(decode(model, codes), item.req.input, rate)
    if decoder_identical:  # same weights, same codes: the audio is identical by construction
        row.update(mrstft=0.0, logmel=0.0)
    else:
        audio = decode(model, item.codes)
        row.update(mrstft=mrstft_distance(audio, item.audio, rate),
                   logmel=log_mel_distance(audio, item.audio, rate))  # fmt: skip
    return row


def summarize(per_item: dict[str, list], n_boot: int = 2000) -> tuple[dict, dict]:
    """Bootstrap summaries of the scalar metrics; per-head code-predictor KL separately."""
    metrics = {
        k: bootstrap_ci(v, n_boot=n_boot) for k, v in per_item.items() if k != "cp_kl_per_head"
    }
    heads = per_item.get("cp_kl_per_head") or []
    per_head = {"cp_kl": np.mean(heads, axis=0).tolist()} if heads and len(heads[0]) else {}
    return metrics, per_head


def candidate_entry(reference: Reference, candidate: Candidate, model, details: dict,
                    per_item: dict[str, list]) -> dict:  # fmt: skip
    metrics, per_head = summarize(per_item, reference.settings.n_boot)
    failures = evaluate_budget(metrics, reference.settings.budget)
    size = weight_bytes(model)
    entry = {
        **candidate.describe(),
        "weight_bytes": size, "size_ratio": size / reference.weight_bytes,
        "metrics": metrics, "per_head": per_head, "per_item": per_item,
        "passed": not failures, "failures": failures,
    }  # fmt: skip
    if "plan" in details:
        entry["quantized_modules"] = len(details["plan"])
    if "gptq" in details:
        entry["gptq_layers"] = details["gptq"]
    return entry


def evaluate(
    reference_path: Path,
    candidates: list[Candidate],
    settings: EvalSettings | None = None,
    *,
    progress: Callable[[str], None] = logger.info,
    reference: Reference | None = None,
) -> dict:
    """The report dict (schema qwen3-tts-quality/1) for `candidates` against the reference."""
    settings = settings or EvalSettings()
    ref = reference or Reference(reference_path, settings, progress=progress)
    noise = ref.noise_summary()
    report = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "reference": {
            "path": str(ref.path),
            "digest": source_digest(ref.path),
            "recipe": "bf16",
            "weight_bytes": ref.weight_bytes,
            "frames": [len(i.codes) for i in ref.items],
            "hit_cap": [i.hit_cap for i in ref.items],
        },  # fmt: skip
        "texts": list(settings.texts),
        "seeds": list(settings.seeds),
        "settings": {
            "max_new_tokens": settings.max_new_tokens,
            "voice": settings.voice,
            "language": settings.language,
            "audio_items": settings.audio_items,
            "noise_seed_offset": settings.noise_seed_offset,
            "n_boot": settings.n_boot,
            "calibration_texts": list(settings.calibration_texts),
            "calibration_frames": settings.calibration_frames,
            "sampling": ref.sampling_options(),
            "versions": versions(),
        },  # fmt: skip
        "budget": settings.budget,
        "noise_floor": noise,
        "candidates": [],
    }
    donors: dict = {}
    for i, cand in enumerate(candidates, 1):
        t0 = time.perf_counter()
        model, details = build(cand, ref.path, calibrate=ref.calibrate, donors=donors)
        if details.get("plan") == {}:
            progress(
                f"note: {cand.name} quantizes no module of this checkpoint (its widths or depth)"
            )
        entry = candidate_entry(ref, cand, model, details, ref.measure(model))
        entry["eval_s"] = time.perf_counter() - t0
        report["candidates"].append(entry)
        m = entry["metrics"]
        progress(f"[{i}/{len(candidates)}] {cand.name}: cb0_kl {m['cb0_kl']['mean']:.4g} "
                 f"cp_kl {m['cp_kl']['mean']:.4g} size {entry['size_ratio']:.2f} "
                 f"{'pass' if entry['passed'] else 'FAIL: ' + '; '.join(entry['failures'])} "
                 f"({entry['eval_s']:.1f}s)")  # fmt: skip
        del model
    compare_gptq(report, settings.n_boot)
    for c in report["candidates"]:
        for metric, d in (c.get("vs_rtn") or {}).items():
            progress(f"{c['name']}: {metric} {d['verdict']}")
    return report


def compare_gptq(report: dict, n_boot: int = 2000) -> None:
    """Each GPTQ candidate against the round-to-nearest one of the same recipe, paired per item:
    the difference of the KLs with its interval, and a verdict that says by how much."""

    rtn = {json_key(c["recipe"]): c for c in report["candidates"] if c["method"] == "rtn"}
    for c in report["candidates"]:
        base = rtn.get(json_key(c["recipe"])) if c["method"] == "gptq" else None
        if base is None:
            continue
        c["vs_rtn"] = {}
        for metric in ("cb0_kl", "cp_kl"):
            d = paired_bootstrap(c["per_item"][metric], base["per_item"][metric], n_boot=n_boot)
            rel = d["mean"] / max(base["metrics"][metric]["mean"], 1e-12)
            if d["mean"] == 0.0:
                verdict = "unchanged (the GPTQ components do not affect it)"
            elif d["ci"][1] >= 0 and d["ci"][0] <= 0:
                verdict = f"no significant change: {rel:+.1%} vs round-to-nearest (CI of the difference includes 0)"
            elif d["mean"] < 0:
                verdict = f"GPTQ lowers it by {-rel:.1%} (CI of the difference {d['ci'][0]:.3g} .. {d['ci'][1]:.3g})"
            else:
                verdict = f"GPTQ does NOT lower it: {rel:+.1%} vs round-to-nearest"
            c["vs_rtn"][metric] = {**d, "relative": rel, "verdict": verdict, "rtn": base["name"]}


def json_key(value) -> str:

    return json.dumps(value, sort_keys=True)
