"""Monitoring under infra/: the Prometheus scrape configuration, the Grafana dashboard and the
files that provision it, and how compose.yaml wires them.

Checked with the tools' own parsers where they are at hand:
- every PromQL expression of the dashboard (panels and annotations) is parsed by `promql-parser`
  (Python bindings of the Rust `promql-parser` crate: it checks functions, argument types and
  selectors, as Prometheus does), after Grafana's own variables are replaced by durations, and
  by promtool too (`check rules`) when it is on PATH;
- infra/prometheus/prometheus.yml is checked by `promtool check config` when a promtool binary is
  on PATH (`go install github.com/prometheus/prometheus/cmd/promtool@v0.316.0`, the release
  compose runs; a large build, never done by this suite), and structurally always: every job's
  targets are compose services on the ports their commands serve;
- the engine's metric names and labels that the dashboard uses are checked against the /metrics
  scrape of a real engine (tiny checkpoint, a governor, one synthesis).

`dashboard_metric_names()` and `scrape_metric_names()` are shared: the agent worker's tests can
check the agent-side names (voice_agent_*, lk_agents_*) against a real worker's scrape with them.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from dataclasses import fields
from functools import cache
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.infra.test_infra import (
    INFRA,
    REPO,
    dockerfile_stages,
    env_of,
    policy_for,
    serve_args,
    tts_engines,
)

DASHBOARD = INFRA / "grafana/dashboards/voice-agent.json"
DATASOURCES = INFRA / "grafana/provisioning/datasources/prometheus.yml"
DASHBOARD_PROVIDERS = INFRA / "grafana/provisioning/dashboards/dashboards.yml"
PROMETHEUS = INFRA / "prometheus/prometheus.yml"
PROVISIONING_DIR = PurePosixPath("/etc/grafana/provisioning")  # the image's GF_PATHS_PROVISIONING

# Grafana's built-in variables the queries may use, and a duration each stands for when parsed.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
# Functions over counters (and histogram buckets): a `_sum`/`_count` selector under one of them is
# part of a histogram or summary, elsewhere (`lk_agents_active_job_count`) a metric of its own.
COUNTER_FUNCTIONS = {"rate", "irate", "increase", "resets"}
# Series Prometheus makes itself for every target: never in a scrape.
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
             "scrape_samples_post_metric_relabeling", "scrape_series_added"}  # fmt: skip
# Labels Prometheus adds to every scraped series (`le` is the histograms' own, in every bucket).
TARGET_LABELS = {"instance", "job"}


# -- the dashboard's queries --------------------------------------------------------------------


@cache
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict] | None = None) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dashboard()["panels"] if panels is None else panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


def queries() -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) of every panel target and every Prometheus annotation."""
    out = []
    for p in all_panels():
        for t in p.get("targets", []):
            out.append(
                (
                    f"panel {p['title']!r} {t.get('refId')}",
                    t.get("expr", ""),
                    t.get("legendFormat", ""),
                )
            )
    for a in dashboard()["annotations"]["list"]:
        if "expr" in a:
            out.append((f"annotation {a['name']!r}", a["expr"], a.get("textFormat", "")))
    return out


def parse(expr: str):
    """The expression as Prometheus would get it from Grafana, parsed."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable the dashboard does not define: {expr}"
    return promql_parser.parse(expr)


def _walk(expr, visit) -> None:
    """visit(node, ancestors) for every node of a parsed expression."""
    stack: list = []

    def pre(node) -> None:
        visit(node, stack)
        stack.append(node)

    def post(node) -> None:
        stack.pop()

    promql_parser.walk(expr, pre, post)


def family_name(selector: str, counted: bool) -> str:
    """The metric family a selected series belongs to, as prometheus-client's text parser names
    it: counters drop `_total`, histogram buckets and counted (`counted`: under rate() and the
    like) `_sum`/`_count` series belong to their base name."""
    for suffix in ("_total", "_bucket") + (("_sum", "_count") if counted else ()):
        if selector.endswith(suffix):
            return selector.removesuffix(suffix)
    return selector


def dashboard_uses() -> dict[str, set[str]]:
    """Family name -> the labels the dashboard groups by or matches on for it."""
    uses: dict[str, set[str]] = {}
    for _, expr, _ in queries():

        def visit(node, ancestors):
            if not isinstance(node, promql_parser.VectorSelector):
                return
            counted = any(isinstance(a, promql_parser.Call) and a.func.name in COUNTER_FUNCTIONS
                          for a in ancestors)  # fmt: skip
            labels = uses.setdefault(family_name(node.name, counted), set())
            labels |= {m.name for m in node.matchers.matchers}
            for a in ancestors:
                if isinstance(a, promql_parser.AggregateExpr) and a.modifier is not None:
                    labels |= set(a.modifier.labels)

        _walk(parse(expr), visit)
    return uses


def dashboard_metric_names() -> set[str]:
    """The metric family names the dashboard's queries use, named as
    `prometheus_client.parser.text_string_to_metric_families` names a scrape's families (no
    `_bucket`/`_sum`/`_count` for histograms, no `_total` for counters): compare them with
    `scrape_metric_names(text)`. Series Prometheus makes itself (`up`) are left out."""
    return set(dashboard_uses()) - SYNTHETIC


def scrape_metric_names(text: str) -> set[str]:
    """The metric family names of a /metrics scrape (families without samples included: a
    labelled metric no code path has touched yet still has its HELP and TYPE lines)."""
    return {f.name for f in text_string_to_metric_families(text)}


def result_labels(expr) -> set[str] | None:
    """The labels an expression's result series carry, where the expression fixes them (None:
    whatever the selected series have)."""
    if isinstance(expr, promql_parser.ParenExpr):
        return result_labels(expr.expr)
    if isinstance(expr, promql_parser.AggregateExpr):
        m = expr.modifier
        if m is None:
            return set()
        return set(m.labels) if m.type == promql_parser.AggModifierType.By else None
    if isinstance(expr, promql_parser.Call) and expr.func.name == "histogram_quantile":
        inner = result_labels(expr.args[1])
        return None if inner is None else inner - {"le"}
    if isinstance(expr, promql_parser.BinaryExpr) and expr.modifier is None:
        sides = [result_labels(s) for s in (expr.lhs, expr.rhs)
                 if not isinstance(s, promql_parser.NumberLiteral)]  # fmt: skip
        if any(s is None for s in sides):
            return None
        return set.intersection(*sides) if sides else set()
    return None


# -- dashboard ----------------------------------------------------------------------------------


def test_dashboard_model_and_layout():
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    panels = all_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    taken: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = p["title"]
    assert d["templating"]["list"] == [], "queries use no variables but Grafana's own"


def test_every_panel_queries_prometheus_with_parsable_promql():
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    ref = {"type": source["type"], "uid": source["uid"]}
    assert source["type"] == "prometheus"
    for p in all_panels():
        if p["type"] == "row":
            continue
        assert p["datasource"] == ref, p["title"]
        targets = p.get("targets")
        assert targets, f"{p['title']!r} has no query"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert t.get("datasource", ref) == ref, p["title"]
            assert t.get("expr"), f"{p['title']!r} {t['refId']} has no expr"
    for a in dashboard()["annotations"]["list"]:
        if "expr" in a:
            assert a["datasource"] == ref, a["name"]
    for where, expr, legend in queries():
        try:
            tree = parse(expr)
        except ValueError as e:
            pytest.fail(f"{where}: {expr}\n  {e}")
        # Every {{label}} of the legend is on the result series (a misspelt label shows nothing).
        wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        have = result_labels(tree)
        if have is not None:
            assert wanted <= have, f"{where}: legend uses {wanted - have}, the query keeps {have}"


def test_the_parser_rejects_broken_promql():
    """The check above means something: promql-parser refuses what Prometheus refuses."""
    for bad in ("rate(voice_agent_turns_total)",  # a range vector is needed
                "sum by (le) rate(x[1m])", "histogram_quantile(0.95, sum(rate(x[1m]))",
                "rat(voice_agent_turns_total[1m])", "x{component=}"):  # fmt: skip
        with pytest.raises(ValueError):
            promql_parser.parse(bad)
    with pytest.raises(AssertionError, match="does not define"):
        parse("rate(x[$interval])")


def test_dashboard_shows_what_operators_look_at_first():
    names = dashboard_metric_names()
    agent = {"lk_agents_active_job_count", "lk_agents_worker_load", "voice_agent_e2e_latency_seconds",
             "voice_agent_end_of_turn_delay_seconds", "voice_agent_llm_node_ttft_seconds",
             "voice_agent_tts_node_ttfb_seconds", "voice_agent_transcription_delay_seconds",
             "voice_agent_added_latency_seconds", "voice_agent_turns", "voice_agent_apologies",
             "voice_agent_interruptions", "voice_agent_errors"}  # fmt: skip
    engine = {"qwen3_tts_first_audio_seconds", "qwen3_tts_queue_depth", "qwen3_tts_requests",
              "qwen3_tts_active_variant", "qwen3_tts_variant_swaps", "qwen3_tts_ladder_position",
              "qwen3_tts_memory_pressure", "qwen3_tts_worker_memory_bytes"}  # fmt: skip
    assert agent | engine <= names, (agent | engine) - names
    uses = dashboard_uses()
    assert {"component", "recoverable"} <= uses["voice_agent_errors"]
    assert "instance" in uses["qwen3_tts_first_audio_seconds"], "first audio per engine"
    assert "nodename" in uses["lk_agents_active_job_count"], "calls per worker"
    # The family names handle suffixes: a gauge that ends in _count keeps it.
    assert family_name("lk_agents_active_job_count", counted=False) == "lk_agents_active_job_count"
    assert (
        family_name("voice_agent_e2e_latency_seconds_count", counted=True)
        == "voice_agent_e2e_latency_seconds"
    )


def _threshold_values(title: str) -> list[float]:
    (panel,) = [p for p in all_panels() if p["title"] == title]
    return [
        s["value"]
        for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
        if s["value"] is not None
    ]


def test_threshold_lines_match_the_deployment(compose):
    """Lines drawn on panels are the values the deployed code acts on."""
    from qwen3_tts_engine.protocol import CHUNK_FRAMES, FRAME_SAMPLES, SAMPLE_RATE
    from voice_agent.settings import Settings

    engines = tts_engines(compose["services"])
    policies = {(p.downgrade_at, p.critical_at)
                for p in (policy_for(serve_args(e["command"])) for e in engines.values())}  # fmt: skip
    assert len(policies) == 1, "one line for both engines"
    assert _threshold_values("Memory pressure") == list(next(iter(policies)))
    chunk_s = CHUNK_FRAMES * FRAME_SAMPLES / SAMPLE_RATE
    assert _threshold_values("Chunk compute p95 (line: real time)") == [pytest.approx(chunk_s)]
    (threshold,) = [f for f in fields(Settings) if f.metadata.get("env") == "AGENT_LOAD_THRESHOLD"]
    deployed = float(
        env_of(compose["services"]["agent"]).get("AGENT_LOAD_THRESHOLD", threshold.default)
    )
    assert _threshold_values("Worker load") == [deployed]


# -- Grafana provisioning and compose -----------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def bind_mounts(service: dict) -> dict[Path, PurePosixPath]:
    """Repository file -> path in the container, for a service's bind mounts (all read-only)."""
    out = {}
    for volume in service.get("volumes", []):
        src, target, *opts = volume.split(":")
        if src.startswith("."):
            assert opts == ["ro"], f"{volume}: configuration is mounted read-only"
            out[(INFRA / src).resolve()] = PurePosixPath(target)
    return out


def published(service: dict) -> dict[int, str]:
    """Container port -> the host address it is published on."""
    out = {}
    for p in service.get("ports", []):
        host, host_port, container_port = str(p).rsplit(":", 2)
        out[int(container_port)] = host
    return out


def prometheus_listen_port(service: dict) -> int:
    (flag,) = [a for a in service["command"] if a.startswith("--web.listen-address=")]
    return int(flag.rsplit(":", 1)[1])


def test_compose_runs_prometheus_and_grafana_locally(compose):
    services = compose["services"]
    prom, graf = services["prometheus"], services["grafana"]
    for name, image in (("prometheus", "prom/prometheus"), ("grafana", "grafana/grafana")):
        repo, _, tag = services[name]["image"].partition(":")
        assert repo == image and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin a release tag"
        # The UIs are published on loopback only (Prometheus has no login at all).
        assert set(published(services[name]).values()) == {"127.0.0.1"}, name
        assert services[name]["read_only"] is True and services[name]["cap_drop"] == ["ALL"], name
        for volume in services[name]["volumes"]:
            src = volume.split(":")[0]
            assert src.startswith(".") or src in compose["volumes"], volume
    assert prometheus_listen_port(prom) in published(prom)
    assert 3000 in published(graf)
    config = prom["command"][
        [a.split("=")[0] for a in prom["command"]].index("--config.file")
    ].split("=", 1)[1]
    assert bind_mounts(prom)[PROMETHEUS.resolve()] == PurePosixPath(config)
    env = env_of(graf)
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?"), (
        "from the environment"
    )
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env.get("GF_USERS_ALLOW_SIGN_UP", "false") == "false"


def test_grafana_provisioning_points_at_the_mounted_files(compose):
    services = compose["services"]
    mounts = bind_mounts(services["grafana"])
    # Provisioning files go where Grafana reads them, one folder per kind.
    assert mounts[DATASOURCES.resolve()].parent == PROVISIONING_DIR / "datasources"
    assert mounts[DASHBOARD_PROVIDERS.resolve()].parent == PROVISIONING_DIR / "dashboards"
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    folder = PurePosixPath(provider["options"]["path"])
    # Every dashboard of the repository is mounted into the folder the provider loads.
    for path in sorted((INFRA / "grafana/dashboards").glob("*.json")):
        assert mounts[path.resolve()].parent == folder, path.name
    home = env_of(services["grafana"]).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert PurePosixPath(home) in mounts.values()
    # The datasource is the compose service, on the port Prometheus listens on, and knows the
    # scrape interval ($__rate_interval is built on it).
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    url = urlparse(source["url"])
    assert url.hostname == "prometheus" and url.port == prometheus_listen_port(
        services["prometheus"]
    )
    assert source["access"] == "proxy"
    assert source["jsonData"]["timeInterval"] == prometheus_config()["global"]["scrape_interval"]
    assert services["grafana"]["depends_on"]["prometheus"]


# -- Prometheus ---------------------------------------------------------------------------------


@cache
def prometheus_config() -> dict:
    return yaml.safe_load(PROMETHEUS.read_text())


def kubernetes_job() -> dict:
    """The commented-out Kubernetes job of prometheus.yml, uncommented."""
    text = PROMETHEUS.read_text()
    block = text.split("# --- kubernetes-pods ---\n", 1)[1].split("# --- end ---", 1)[0]
    (job,) = yaml.safe_load("\n".join(line.removeprefix("#") for line in block.splitlines()))
    return job


def test_scrape_jobs_reach_the_compose_services(compose):
    services = compose["services"]
    jobs = prometheus_config()["scrape_configs"]
    assert len({j["job_name"] for j in jobs}) == len(jobs)
    scraped: dict[str, int] = {}
    for job in jobs:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        assert job.get("scheme", "http") == "http" and "authorization" not in job, job["job_name"]
        sds = [k for k in job if k.endswith("_configs") and k != "relabel_configs"]
        assert sds and set(sds) <= {"static_configs", "dns_sd_configs"}, job["job_name"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A" and dns["port"], job["job_name"]
            for name in dns["names"]:
                scraped[name] = int(dns["port"])
    assert set(scraped) <= set(services), f"not compose services: {set(scraped) - set(services)}"
    # Every engine, on the port its `qwen3-tts serve` command listens on (every interface).
    engines = tts_engines(services)
    assert set(engines) <= set(scraped), "every engine is scraped"
    for name, engine in engines.items():
        args = serve_args(engine["command"])
        assert scraped[name] == args.port and args.host == "0.0.0.0", name
    # Every agent worker replica (DNS: one A record per container), on METRICS_PORT.
    agent_job = [j for j in jobs if any("agent" in d["names"] for d in j.get("dns_sd_configs", []))]
    assert agent_job, "the agent service has replicas: discover them by DNS, not a static target"
    assert scraped["agent"] == int(env_of(services["agent"])["METRICS_PORT"])


def test_agent_metrics_listen_where_prometheus_scrapes(compose):
    """Prometheus reaches a worker on the compose network: the worker's health/metrics server
    must bind every interface (AGENT_HTTP_HOST; from compose, else the image, else the default)."""
    from voice_agent.settings import Settings

    (setting,) = [f for f in fields(Settings) if f.metadata.get("env") == "AGENT_HTTP_HOST"]
    image_env = dict(rest.split("=", 1) for word, rest in dockerfile_stages()["agent"]
                     if word == "ENV" and "=" in rest)  # fmt: skip
    host = env_of(compose["services"]["agent"]).get(
        "AGENT_HTTP_HOST", image_env.get("AGENT_HTTP_HOST", setting.default)
    )
    assert host in ("0.0.0.0", "::"), (
        f"the agent's metrics bind {host}: Prometheus cannot reach them"
    )


def test_kubernetes_job_uses_the_annotations_the_pods_carry():
    job = kubernetes_job()
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    sources = {s for r in job["relabel_configs"] for s in r.get("source_labels", [])}
    notes = set()
    for rel in ("k8s/agent-worker.yaml", "k8s/tts-engine.yaml"):
        for doc in yaml.safe_load_all((INFRA / rel).read_text()):
            if doc and doc["kind"] == "Deployment":
                notes |= set(doc["spec"]["template"]["metadata"].get("annotations", {}))
    assert {"prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"} <= notes
    for note in notes:
        if note.startswith("prometheus.io/"):
            # Prometheus turns the annotation's name into a label name this way.
            label = "__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", note)
            assert label in sources, f"{note} is set on the pods but not used"


@pytest.fixture(scope="module")
def promtool():
    cached = REPO / ".cache" / "bin" / "promtool"  # scripts/install_promtool.sh
    binary = str(cached) if cached.is_file() else shutil.which("promtool")
    if binary is None:
        pytest.skip("no promtool: run scripts/install_promtool.sh (the test command does)")
    return binary


def test_promtool_accepts_the_scrape_config(promtool, tmp_path):
    def check(path: Path) -> None:
        out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr

    check(PROMETHEUS)
    with_k8s = tmp_path / "prometheus.yml"
    jobs = [*prometheus_config()["scrape_configs"], kubernetes_job()]
    with_k8s.write_text(yaml.safe_dump({**prometheus_config(), "scrape_configs": jobs}))
    check(with_k8s)
    # The check is real: promtool refuses an unknown field.
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({**prometheus_config(), "scrape_configz": []}))
    assert (
        subprocess.run([promtool, "check", "config", str(bad)], capture_output=True).returncode != 0
    )


def test_promtool_parses_every_dashboard_query(promtool, tmp_path):
    """Prometheus's own parser on the dashboard's queries, as recording rules."""
    rules = [{"record": f"dashboard:query_{i}", "expr": expr}
             for i, (_, expr, _) in enumerate(queries())]  # fmt: skip
    for rule in rules:
        for name, value in GRAFANA_VARIABLES.items():
            rule["expr"] = rule["expr"].replace(name, value)
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0 and f"{len(rules)} rules found" in out.stdout, (
        out.stdout + out.stderr
    )


# -- the engine's names against a real engine ----------------------------------------------------

API_KEY = "observability-key"


async def engine_scrape(model: Path) -> tuple[str, dict[str, set[str]]]:
    """/metrics of a real engine (worker process, governor) after one synthesis, and the label
    names each of its metrics declares (family name -> labels)."""
    from prometheus_client.metrics import MetricWrapperBase

    from qwen3_tts_engine.dispatch.engine import Engine
    from qwen3_tts_engine.dispatch.handler import Handler
    from qwen3_tts_engine.governor.governor import Governor
    from qwen3_tts_engine.governor.memory import ManualProbe
    from qwen3_tts_engine.governor.policy import Policy
    from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

    probe = ManualProbe(limit_bytes=64 << 30, pressure=0.3)
    policy = Policy()
    engine = Engine(str(model), [Handler(str(model), policy.ladder[0])])
    governor = Governor(engine, probe, policy, interval_s=0.05, allow_unevaluated=("all",))
    server = EngineServer(engine, ServerConfig(port=0, api_key=API_KEY), governor)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}",
                                     timeout=httpx.Timeout(120)) as c:  # fmt: skip
            body = {"input": "Hello from the dashboard test.", "voice": "ryan", "language": "en",
                    "seed": 1, "max_new_tokens": 4, "response_format": "pcm"}  # fmt: skip
            r = await c.post(
                "/v1/audio/speech", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
            )
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while (
                governor.reading is None or governor.position is None
            ):  # the governor's first look
                assert time.monotonic() < deadline, await governor.status()
                await asyncio.sleep(0.05)
            r = await c.get("/metrics")  # no key: Prometheus sends none
            assert r.status_code == 200
            declared = {m._name: set(m._labelnames) for m in vars(server.metrics).values()
                        if isinstance(m, MetricWrapperBase)}  # fmt: skip
            return r.text, declared
    finally:
        await server.stop()


@pytest.mark.slow
async def test_engine_metric_names_and_labels_match_a_real_scrape(tiny_checkpoint):
    text, declared = await engine_scrape(tiny_checkpoint("custom_voice"))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    uses = {
        name: labels for name, labels in dashboard_uses().items() if name.startswith("qwen3_tts_")
    }
    assert uses, "the dashboard shows the engines"
    missing = set(uses) - set(families)
    assert not missing, f"the dashboard queries engine metrics the engine does not serve: {missing}"
    # Only swaps need an event (a swap is as slow as a start: tests/engine/governor/test_swap.py makes
    # them); every other series the dashboard shows is there after one synthesis.
    events = {"qwen3_tts_variant_swaps"}
    empty = {name for name in uses if not families[name].samples}
    assert empty <= events, f"no samples after a synthesis: {empty - events}"
    for name, labels in uses.items():
        samples = families[name].samples
        have = set().union(*(s.labels for s in samples)) if samples else declared[name]
        unknown = labels - TARGET_LABELS - {"le"} - have
        assert not unknown, f"{name}: the dashboard uses labels {unknown}; the engine has {have}"
    # Label values the dashboard matches on exist (kind="rss", ...) where the series are there.
    for _, expr, _ in queries():

        def visit(node, ancestors):
            if isinstance(node, promql_parser.VectorSelector) and node.name.startswith(
                "qwen3_tts_"
            ):
                counted = any(isinstance(a, promql_parser.Call) and a.func.name in COUNTER_FUNCTIONS
                              for a in ancestors)  # fmt: skip
                family = families[family_name(node.name, counted)]
                for m in node.matchers.matchers if family.samples else ():
                    values = {s.labels.get(m.name) for s in family.samples}
                    wanted = m.value.split("|") if m.op == promql_parser.MatchOp.Re else [m.value]
                    assert set(wanted) <= values, (
                        f"{node.name}{{{m.name}}}: {wanted} not in {values}"
                    )

        _walk(parse(expr), visit)
