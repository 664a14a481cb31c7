"""Quantization quality on tiny random checkpoints: metrics that can fail, ablation, GPTQ, CLI.

Tiny checkpoints have random weights, so the numbers only show that the machinery measures what
it claims: zero against itself, more damage at fewer bits, the corrupted component found first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwen3_tts_engine.models.components import only
from qwen3_tts_engine.models.recipes import RECIPES, load_recipe
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.quant.candidates import Candidate, build, load_dir
from qwen3_tts_engine.quant.evaluate import EvalSettings, Reference, evaluate
from qwen3_tts_engine.quant.forced import _allowed_cb0, teacher_forced
from qwen3_tts_engine.quant.free_running import generate_codes, generate_codes_batched
from qwen3_tts_engine.worker.loading import component_paths

TEXTS = EvalSettings().texts
SMALL = dict(texts=TEXTS[:3], seeds=(0,), max_new_tokens=12, language="english", n_boot=300)


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).with_name("qwen3-tts"))
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy()
    )


def test_teacher_forcing_reproduces_greedy_generation(tiny_checkpoint):
    """Forced along its own greedy codes, a model's argmax is exactly those codes (all 16)."""
    model = load_dir(tiny_checkpoint())
    req = SpeechRequest(input=TEXTS[0], voice="ryan", language="english", seed=3,
                        max_new_tokens=20, top_k=1, repetition_penalty=1.0)  # fmt: skip
    codes, hit_cap = generate_codes(model, req)
    assert codes.shape == (20, 16) and hit_cap
    forced = teacher_forced(model, req, codes)
    allowed = _allowed_cb0(model.config.talker_config)
    assert (allowed[forced.cb0.argmax(-1)][:20] == codes[:, 0]).all()
    assert (forced.cp.argmax(-1) == codes[:, 1:]).all()
    assert forced.cb0.shape[0] == 21 and forced.eos.shape == (21,)  # one row after the last frame


def test_batched_generation_gives_each_request_its_own_codes(tiny_checkpoint):
    """GPTQ's calibration runs its texts in one batch (max_batch 2 here: one waits): the codes
    are those each request gets alone, and where each stopped."""
    model = load_dir(tiny_checkpoint())
    reqs = [SpeechRequest(input=t, voice="ryan", language="english", seed=7 + i, max_new_tokens=10 + 3 * i)
            for i, t in enumerate(TEXTS[:3])]  # fmt: skip
    batched = generate_codes_batched(model, reqs, max_batch=2)
    for req, (codes, hit_cap) in zip(reqs, batched, strict=True):
        alone, alone_cap = generate_codes(model, req)
        assert codes.shape == alone.shape and (codes == alone).all() and hit_cap == alone_cap


def test_reference_against_itself_and_fewer_bits_hurt_more(tiny_checkpoint):
    report = evaluate(tiny_checkpoint(), [
        Candidate("bf16", "reference"),
        Candidate("8bit", recipe=RECIPES["8bit"]),
        Candidate("4bit", recipe=RECIPES["4bit"]),
    ], EvalSettings(**SMALL), progress=print)  # fmt: skip
    ref, w8, w4 = (c["metrics"] for c in report["candidates"])
    for name in ("cb0_kl", "cp_kl", "eos_drift"):
        assert ref[name]["mean"] == 0.0 and ref[name]["ci"] == [0.0, 0.0], name
    assert ref["cb0_top1"]["mean"] == ref["cp_top1"]["mean"] == 1.0
    assert ref["length_ratio"]["mean"] == 1.0 and ref["first_divergence"]["mean"] == 12.0
    print({n: (w8[n]["mean"], w4[n]["mean"]) for n in ("cb0_kl", "cp_kl", "cb0_top1", "cp_top1")})
    assert 0.0 < w8["cb0_kl"]["mean"] < w4["cb0_kl"]["mean"]
    assert 0.0 < w8["cp_kl"]["mean"] < w4["cp_kl"]["mean"]
    assert w4["cp_top1"]["mean"] < w8["cp_top1"]["mean"] <= 1.0
    assert len(report["candidates"][2]["per_head"]["cp_kl"]) == 15
    assert report["candidates"][2]["size_ratio"] < report["candidates"][1]["size_ratio"] < 1.0
    lo, hi = w4["cb0_kl"]["ci"]
    assert lo <= w4["cb0_kl"]["mean"] <= hi


def _corrupt(src: Path, dst: Path, component: str) -> Path:
    """A copy of `src` with Gaussian noise (half the weights' std) on one component's Linears."""
    import mlx.core as mx

    shutil.copytree(src, dst)
    paths = component_paths(load_dir(src), component)
    weights = mx.load(str(dst / "model.safetensors"))
    rng = np.random.default_rng(0)
    hit = 0
    for key in list(weights):
        if key.removesuffix(".weight") in paths:
            w = np.array(weights[key].astype(mx.float32))
            noisy = w + rng.normal(0, 0.5 * w.std(), w.shape).astype(np.float32)
            weights[key] = mx.array(noisy).astype(weights[key].dtype)
            hit += 1
    assert hit == len(paths) > 0
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


# four of the nine components (each one costs two candidates): the two corrupted ones below and
# two that hold as many weights (every talker layer's MLP; the talker's last layer overlaps
# talker-attention)
ABLATED = ["talker-attention", "talker-mlp", "talker-last-layer", "code-predictor"]


@pytest.mark.parametrize("component", ["talker-attention", "code-predictor"])
def test_ablation_ranks_the_corrupted_component_first(tiny_checkpoint, tmp_path, component):
    from qwen3_tts_engine.quant.ablate import ablate

    src = tiny_checkpoint()
    donor = _corrupt(src, tmp_path / "corrupted", component)
    settings = EvalSettings(**{**SMALL, "texts": TEXTS[:2], "max_new_tokens": 8})
    report = ablate(src, donor=donor, components=ABLATED, settings=settings, progress=print)
    ranking = report["ablation"]["ranking"]
    print([(r["component"], round(r["damage_only"], 5)) for r in ranking])
    assert ranking[0]["component"] == component
    assert ranking[0]["damage_only"] > 0.0
    # grafting everything but the corrupted component changes nothing
    assert ranking[0]["damage_all_but"] == 0.0
    assert len(report["candidates"]) == 2 * len(ABLATED)
    assert sorted(r["component"] for r in ranking) == sorted(ABLATED)


def test_gptq_lowers_code_predictor_kl_versus_round_to_nearest(tiny_checkpoint):
    settings = EvalSettings(**{**SMALL, "calibration_frames": 60})
    ref = Reference(tiny_checkpoint(), settings, progress=print)
    recipe = only("code-predictor", 4)
    report = evaluate(ref.path, [Candidate("rtn", recipe=recipe),
                                 Candidate("gptq", "gptq", recipe=recipe, gptq=("code-predictor",))],
                      settings, progress=print, reference=ref)  # fmt: skip
    rtn, gptq = report["candidates"]
    ratio = gptq["metrics"]["cp_kl"]["mean"] / rtn["metrics"]["cp_kl"]["mean"]
    print(f"code-predictor KL at 4 bits: GPTQ / RTN = {ratio:.3f}")
    layers = gptq["gptq_layers"]
    assert len(layers) == len(component_paths(ref.model, "code-predictor"))
    assert all(la["gptq_error"] < la["rtn_error"] for la in layers)  # on the calibration data
    assert ratio < 1.0  # and on held-out texts (measured 0.97 with 720 calibration frames)
    paired = gptq["vs_rtn"]["cp_kl"]
    assert paired["mean"] < 0 and paired["verdict"].startswith("GPTQ lowers it by")
    assert gptq["vs_rtn"]["cb0_kl"]["verdict"].startswith("unchanged")  # only the code predictor
    assert gptq["quantized_modules"] == rtn["quantized_modules"]


def test_quantize_cli_with_a_yaml_recipe_and_gptq_loads_and_streams(tiny_checkpoint, tmp_path):
    from qwen3_tts_engine.worker.synthesis import stream_chunks

    recipe = tmp_path / "mixed.yaml"
    recipe.write_text(
        "name: mixed\ndefault_bits: 4\ndefault_group_size: 32\nrules:\n"
        "  - component: code-predictor\n    bits: 8\n"
        "  - pattern: 'mlp\\.down_proj$'\n    bits: 6\n    group_size: 128\n"
        "  - component: text-projection\n    bits: null\n"
    )
    out = tmp_path / "mixed-ckpt"
    r = cli("quantize", str(tiny_checkpoint()), str(out), "--recipe", str(recipe),
            "--gptq", "code-predictor", "--calibration-frames", "16", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["method"] == "gptq" and result["bits"] == [4, 6, 8]
    assert result["weight_bytes"] < result["source_weight_bytes"]
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["talker.code_predictor.lm_head.3"] == {"bits": 8, "group_size": 32}
    assert quant["talker.model.layers.0.mlp.down_proj"] == {
        "bits": 6,
        "group_size": 128,
    }  # 128 wide
    assert quant["talker.model.layers.0.mlp.up_proj"] == {"bits": 4, "group_size": 32}
    assert not any(k.startswith("talker.text_projection") for k in quant)

    from mlx_audio.tts.utils import load_model

    model = load_model(out)  # mlx-audio's own loader
    assert model.talker.code_predictor.lm_head[3].bits == 8
    req = SpeechRequest(input="Hello there.", voice="ryan", seed=1, max_new_tokens=4)
    chunks = list(stream_chunks(model, req))
    assert [c.frames for c in chunks] == [4] and chunks[0].audio.shape == (7680,)
    assert np.isfinite(chunks[0].audio).all()


def test_eval_cli_writes_json_markdown_png_and_stores_verdicts(tiny_checkpoint, tmp_path):
    out = tmp_path / "report"
    r = cli("eval", "--reference", str(tiny_checkpoint()), "--candidates", "8bit,4bit",
            "--texts", "2", "--seeds", "0", "--max-new-tokens", "4", "--audio-items", "1",
            "--language", "english", "--out", str(out), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert [c["name"] for c in summary["candidates"]] == ["8bit", "4bit"]
    for c in summary["candidates"]:
        assert {"cb0_kl", "cp_kl", "silence_rate", "cer", "mrstft"} <= set(c["metrics"])
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "qwen3-tts-quality/1" and report["settings"]["audio_items"] == 1
    md = (out / "report.md").read_text()
    assert "| 8bit | rtn |" in md and "| 4bit | rtn |" in md and "cb0_kl" in md
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(summary["stored"]) == 2
    for path in summary["stored"]:
        verdict = json.loads(Path(path).read_text())
        assert verdict["passed"] == next(
            c["passed"] for c in summary["candidates"] if c["name"] == verdict["recipe"]
        )
        assert verdict["report"] == str(out / "report.json")


def test_ablate_cli_proposes_a_recipe_inside_the_budget(tiny_checkpoint, tmp_path):
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"cp_kl": {"max": 0.004}}))  # 4-bit everywhere breaks it
    out = tmp_path / "ablation"
    r = cli("ablate", "--reference", str(tiny_checkpoint()), "--bits", "4", "--texts", "2",
            "--components", "code-predictor,codec-head,talker-mlp",
            "--seeds", "0", "--max-new-tokens", "8", "--audio-items", "0", "--language", "english",
            "--budget", str(budget), "--out", str(out), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    proposal = summary["proposal"]
    print(summary["ranking"], proposal)
    assert summary["ranking"][0]["component"] == "code-predictor"
    assert proposal["kept"] == ["code-predictor"] and proposal["tried"][0] == "w4g64"
    assert proposal["size_ratio"] < 1.0
    recipe = load_recipe(str(out / "proposed-recipe.json"))
    passing = [c for c in summary["candidates"] if c["name"] == recipe.name]
    assert passing and passing[0]["passed"] and passing[0]["metrics"]["cp_kl"] <= 0.004
    failing = [c for c in summary["candidates"] if c["name"] == "w4g64"]
    assert failing and not failing[0]["passed"]
    md = (out / "report.md").read_text()
    assert "| 1 | code-predictor |" in md and f"Proposed recipe: `{recipe.name}`" in md


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "--candidates", "9bit"], "neither a built-in recipe"),
        (["eval", "--candidates", "4bit", "--gptq", "decoder"], "unknown --gptq component"),
        (["eval", "--candidates", "4bit", "--gptq", "text-embedding"], "unknown --gptq component"),
        (["eval", "--seeds", "a,b"], "--seeds must be integers"),
        (["ablate", "--components", "nothing"], "unknown component"),
        (["ablate", "--bits", "8", "--keep-bits", "6"], "must be more than --bits"),
        (["eval", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["eval", "--audio-items", "-1"], "--audio-items must be >= 0"),
        (["eval", "--seeds", "-1"], "each >= 0"),
        (["quantize", "/nonexistent/ckpt", "/tmp/x", "--recipe", "4bit"], "does not exist"),
    ],
)
def test_quality_cli_rejects_bad_input(tiny_checkpoint, args, message):
    if args[0] != "quantize":  # small defaults for what the case does not set itself
        defaults = {"--reference": str(tiny_checkpoint()), "--texts": "1", "--seeds": "0",
                    "--max-new-tokens": "2", "--audio-items": "0"}  # fmt: skip
        args = [*args, *(x for k, v in defaults.items() if k not in args for x in (k, v))]
    r = cli(*args, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert message in r.stderr


@pytest.mark.parametrize("name, text, message", [
    ("budget.json", json.dumps({"kl": {"max": 1}}), "unknown metric 'kl'"),
    ("budget.json", json.dumps({"cb0_kl": {"min": 2, "max": 1}}), "min > max"),
    ("budget.yaml", "cb0_kl: {max: [", "cannot read budget"),
    ("budget.json", json.dumps({"cb0_kl": {"max": "low"}}), "needs {max: number}"),
])  # fmt: skip
def test_budget_file_errors(tiny_checkpoint, tmp_path, name, text, message):
    bad = tmp_path / name
    bad.write_text(text)
    r = cli("eval", "--reference", str(tiny_checkpoint()), "--budget", str(bad), timeout=300)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]


def test_quantize_never_replaces_a_folder_it_did_not_write(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    r = cli("quantize", str(src), str(notes), "--recipe", "8bit", timeout=300)
    assert r.returncode == 2 and "non-empty folder" in r.stderr
    assert (notes / "keep.txt").read_text() == "mine"
    r = cli("quantize", str(src), str(src.parent), "--recipe", "8bit", timeout=300)
    assert (
        r.returncode == 2
        and "must be outside the source" in r.stderr
        and (src / "config.json").is_file()
    )
    out = tmp_path / "q8"
    assert cli("quantize", str(src), str(out), "--recipe", "8bit", timeout=300).returncode == 0
    assert (
        cli("quantize", str(src), str(out), "--recipe", "4bit", timeout=300).returncode == 0
    )  # its own output
    assert json.loads((out / "config.json").read_text())["qwen3_tts_recipe"] == "4bit"
    assert not list(out.glob("*.index.json"))  # no stale index of the source's weights


def test_graft_and_build_keep_the_reference_intact(tiny_checkpoint):
    """Building a candidate never modifies the reference's weights on disk or in memory."""
    src = tiny_checkpoint()
    ref = load_dir(src)
    model, details = build(Candidate("4bit", recipe=RECIPES["4bit"]), src)
    assert details["plan"] and type(model.talker.codec_head).__name__ == "QuantizedLinear"
    assert type(ref.talker.codec_head).__name__ == "Linear"


def test_decoder_metrics_see_a_changed_vocoder(tiny_checkpoint):
    """Decoder distances are 0 for the same vocoder and grow when its weights change."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from qwen3_tts_engine.quant.evaluate import audio_metrics, same_decoder

    settings = EvalSettings(
        texts=TEXTS[:1], seeds=(0,), max_new_tokens=4, language="english", audio_items=1
    )
    ref = Reference(tiny_checkpoint(), settings, progress=print)
    item = ref.items[0]
    assert item.audio is not None and item.audio.shape == (4 * 1920,)
    same = audio_metrics(
        ref.model, item, item.codes, False, ref.sample_rate
    )  # computed, not assumed
    assert same["mrstft"] == 0.0 and same["logmel"] == 0.0

    other = load_dir(tiny_checkpoint())
    params = tree_flatten(other.speech_tokenizer.decoder.parameters())
    key, w = max(params, key=lambda kv: kv[1].size)  # the largest vocoder tensor
    noise = mx.random.normal(w.shape, key=mx.random.key(0)).astype(w.dtype) * mx.std(
        w.astype(mx.float32)
    ).astype(w.dtype)
    other.speech_tokenizer.decoder.update(tree_unflatten([(key, w + noise)]))
    assert not same_decoder(ref.model, other)
    changed = audio_metrics(other, item, item.codes, False, ref.sample_rate)
    print(key, changed)
    assert changed["mrstft"] > 0.05 and changed["logmel"] > 0.05


def _eos_row(src: Path, dst: Path, scale: float) -> Path:
    """A copy of `src` with the talker's EOS logit row scaled (0: the model can never stop)."""
    import mlx.core as mx

    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    key = "talker.codec_head.weight"
    w = np.array(weights[key].astype(mx.float32))
    w[load_dir(src).config.talker_config.codec_eos_token_id] *= scale
    weights[key] = mx.array(w).astype(weights[key].dtype)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


def test_free_running_metrics_catch_a_candidate_that_never_stops(tiny_checkpoint, tmp_path):
    """Reference: EOS made likely (it stops after 1-40 frames); candidate: EOS row zeroed."""
    ref = _eos_row(tiny_checkpoint(eos=True), tmp_path / "stops", 3.0)
    never = _eos_row(ref, tmp_path / "never-stops", 0.0)
    settings = EvalSettings(
        texts=TEXTS[:4], seeds=(0,), max_new_tokens=40, language="english", n_boot=300
    )
    report = evaluate(ref, [Candidate("same", "checkpoint", path=ref),
                            Candidate("never-stops", "checkpoint", path=never)], settings)  # fmt: skip
    same, bad = (c["metrics"] for c in report["candidates"])
    stopped = [not cap for cap in report["reference"]["hit_cap"]]
    print(
        report["reference"]["frames"],
        {k: bad[k]["mean"] for k in ("runaway_rate", "length_ratio", "eos_drift")},
    )
    assert sum(stopped) >= 3  # the reference stops by itself on most items
    assert same["runaway_rate"]["mean"] == 0.0 and same["length_ratio"]["mean"] == 1.0
    assert bad["runaway_rate"]["mean"] == sum(stopped) / len(stopped)
    assert bad["length_ratio"]["mean"] > 2.0
    assert bad["eos_drift"]["mean"] > 0.005 and same["eos_drift"]["mean"] == 0.0  # measured 0.011
    assert not report["candidates"][1]["passed"] and report["candidates"][0]["passed"]


def test_run_comparisons():
    from qwen3_tts_engine.quant.free_running import compare_runs, first_divergence

    a = np.arange(10 * 16).reshape(10, 16)
    b = a.copy()
    b[6, 15] += 1
    assert first_divergence(a, a) == 10 and first_divergence(a, b) == 6
    assert first_divergence(a, a[:4]) == 4  # a prefix diverges where it ends
    assert compare_runs(a, a[:5], False, False) == {
        "length_ratio": 0.5,
        "runaway_rate": 0.0,
        "first_divergence": 5.0,
    }
    assert (
        compare_runs(a, b, True, False)["runaway_rate"] == 1.0
    )  # capped where the reference stopped
    assert (
        compare_runs(a, b, True, True)["runaway_rate"] == 0.0
    )  # both capped: not the candidate's fault


def test_voice_design_checkpoints_are_evaluated_with_instructions(tiny_checkpoint):
    from qwen3_tts_engine.protocol import RequestError

    model = tiny_checkpoint("voice_design")
    settings = EvalSettings(texts=TEXTS[:1], seeds=(0,), max_new_tokens=4, n_boot=100)
    with pytest.raises(RequestError, match="needs `instructions`"):
        evaluate(model, [Candidate("8bit", recipe=RECIPES["8bit"])], settings)
    settings.instructions = "A calm, low voice."
    report = evaluate(model, [Candidate("8bit", recipe=RECIPES["8bit"])], settings)
    assert report["candidates"][0]["metrics"]["cb0_kl"]["mean"] > 0.0
