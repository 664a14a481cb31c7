"""The governor's quality gate: quantized rungs need a stored passing report or operator consent."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.governor import gate
from qwen3_tts_engine.governor.governor import Governor
from qwen3_tts_engine.governor.memory import ManualProbe
from qwen3_tts_engine.governor.policy import Policy
from qwen3_tts_engine.models.recipes import RECIPES
from qwen3_tts_engine.quant.candidates import Candidate
from qwen3_tts_engine.quant.evaluate import EvalSettings, evaluate
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

pytestmark = pytest.mark.slow
LADDER = ("bf16", "8bit", "6bit", "4bit")
BUDGET = {"cp_kl": {"max": 0.004}}


@pytest.fixture(scope="module")
def evaluated(tiny_checkpoint, tmp_path_factory):
    """A real evaluation whose budget 8-bit meets and 4-bit breaks; verdicts stored."""
    model = tiny_checkpoint()
    settings = EvalSettings(texts=EvalSettings().texts[:2], seeds=(0,), max_new_tokens=8,
                            language="english", budget=BUDGET)  # fmt: skip
    report = evaluate(model, [Candidate("8bit", recipe=RECIPES["8bit"]),
                              Candidate("4bit", recipe=RECIPES["4bit"])], settings)  # fmt: skip
    stored = gate.store(report, tmp_path_factory.mktemp("report") / "report.json", model)
    assert len(stored) == 2
    return model


def test_check_rung_reasons(evaluated, tiny_checkpoint):
    ok = gate.check_rung(evaluated, "8bit", budget=BUDGET, min_items=2)
    assert ok["accepted"] and ok["why"] == "stored passing report" and ok["report"]["passed"]
    # the engine's own budget and sample size apply, not only the one the report was made with
    strict = gate.check_rung(evaluated, "8bit", budget={"cp_kl": {"max": 1e-5}}, min_items=2)
    assert not strict["accepted"] and "cp_kl" in strict["why"]
    few = gate.check_rung(evaluated, "8bit", budget=BUDGET, min_items=6)
    assert not few["accepted"] and "evaluated on 2 items < 6 required" in few["why"]
    bad = gate.check_rung(evaluated, "4bit")
    assert not bad["accepted"] and bad["why"].startswith("stored report fails: cp_kl")
    missing = gate.check_rung(evaluated, "6bit")
    assert (
        not missing["accepted"]
        and "no quality report" in missing["why"]
        and missing["report"] is None
    )
    assert gate.check_rung(evaluated, "4bit", consent=frozenset({"4bit"}))["accepted"]
    assert gate.check_rung(evaluated, "6bit", consent=frozenset({"all"}))["accepted"]
    assert gate.check_rung(evaluated, "4bit", start="4bit")["accepted"]  # the operator started it
    assert gate.check_rung(evaluated, "bf16")["accepted"]
    # another checkpoint (other weights, other digest) has no reports
    other = tiny_checkpoint(seed=7)
    assert not gate.check_rung(other, "8bit")["accepted"]
    # a recipe that changed under the same name does not inherit the verdict
    assert gate.lookup(evaluated, RECIPES["8bit"]) is not None
    assert gate.lookup(evaluated, replace(RECIPES["8bit"], default_group_size=32)) is None
    with pytest.raises(ValueError, match="unknown variant"):
        Governor(
            Engine(str(evaluated), [Handler(str(evaluated), "bf16")]),
            ManualProbe(),
            Policy(ladder=LADDER),
            allow_unevaluated=("8bti",),
        )


async def _status(model: str, consent: tuple[str, ...]) -> dict:
    engine = Engine(model, [Handler(model, "bf16")])
    governor = Governor(engine, ManualProbe(), Policy(ladder=LADDER), auto=False,
                        allow_unevaluated=consent, quality_budget=BUDGET, quality_min_items=2)  # fmt: skip
    server = EngineServer(engine, ServerConfig(port=0), governor)
    await server.start()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", timeout=60
        ) as client:
            r = await client.get("/v1/engine/status")
            assert r.status_code == 200
            return r.json()["governor"]
    finally:
        await server.stop()


async def test_ladder_keeps_only_rungs_with_passing_reports(evaluated):
    g = await _status(str(evaluated), ())
    assert g["ladder"] == ["bf16", "8bit"]
    rungs = g["quality_gate"]["rungs"]
    assert rungs["8bit"]["accepted"] and rungs["8bit"]["report"]["metrics"]["cp_kl"] <= 0.004
    assert not rungs["4bit"]["accepted"] and "cp_kl" in rungs["4bit"]["why"]
    assert not rungs["6bit"]["accepted"] and rungs["6bit"]["report"] is None
    assert rungs["bf16"]["accepted"] and rungs["bf16"]["why"].startswith("full precision")
    assert g["quality_gate"]["budget"] == BUDGET and g["quality_gate"]["min_items"] == 2


async def test_operator_consent_puts_unevaluated_rungs_back(evaluated):
    g = await _status(str(evaluated), ("6bit", "4bit"))
    assert g["ladder"] == list(LADDER)
    assert g["quality_gate"]["allow_unevaluated"] == ["4bit", "6bit"]
    assert g["quality_gate"]["rungs"]["4bit"]["why"].startswith("operator consent")
