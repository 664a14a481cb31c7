"""The deployment files under infra/: every YAML and JSON file parses, and they agree with each
other and with the code they deploy.

No docker engine, kubectl, kustomize or kubeconform is installed on the machines that run this
suite, so nothing is built or applied: the checks are structural (compose wiring, Kubernetes
object shapes, resource arithmetic against the governor's ladder, files a Dockerfile copies) plus
the real parsers where one is at hand:
- the `qwen3-tts serve` command lines are parsed by the CLI's own argparse parser;
- the SIP trunk and dispatch rule are parsed into livekit-api's protobuf messages (unknown fields
  fail);
- the LiveKit server configuration is parsed strictly by the pinned `livekit-server` binary
  (`ports --config`) and booted once on loopback, when the binary is present
  (`scripts/install_livekit_server.sh`; skipped otherwise).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import time
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from google.protobuf.json_format import ParseDict, ParseError

from tests.support.engine_process import free_port
from voice_agent.harness.livekit_server import (
    LiveKitServer,
    find_binary,
    free_udp_port,
    stop_server,
)

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
EXPECTED = [
    "README.md", "compose.yaml", "livekit/livekit.yaml", "sip/sip.yaml", "sip/README.md",
    "sip/inbound-trunk.json", "sip/dispatch-rule.json", "docker/agent.Dockerfile",
    "k8s/agent-worker.yaml", "k8s/tts-engine.yaml", "k8s/call-keeper.yaml", "k8s/kustomization.yaml",
    "k8s/tts-inferencepool.yaml", "haproxy/haproxy.cfg",
]  # fmt: skip

MB = 10**6
# Streams in flight that a make-before-break swap must leave room for: `--max-batch` streams,
# each this many seconds (12.5 frames a second) into its utterance, by what a stream holds
# (models/stream_memory.py: the talker's cache rows, code predictor, vocoder window and chunk
# transient; `memory_plan.real_stream_layout`). The limit itself holds `--max-batch` streams at
# the frame cap (`memory_plan.EngineMemory.limit_for_streams`).
IN_FLIGHT_SECONDS = 10

# Variables the deployment may set that are not voice-agent settings.
OTHER_ENV = {
    "LIVEKIT_URL",
    "LIVEKIT_API_KEY",
    "LIVEKIT_API_SECRET",
    "NUM_CPUS",
    "QWEN3_TTS_API_KEY",
}
# Top-level keys of livekit/sip's pkg/config Config (yaml tags).
SIP_CONFIG_KEYS = {
    "redis", "api_key", "api_secret", "ws_url", "health_port", "prometheus_port", "pprof_port",
    "sip_port", "sip_port_listen", "sip_hostname", "outbound_route_headers",
    "sip_ringing_interval", "tcp", "tls", "rtp_port", "logging", "cluster_id",
    "max_cpu_utilization", "max_active_calls", "sip_trunk_ids", "use_external_ip", "local_net",
    "nat_1_to_1_ip", "listen_ip", "udp_max_payload", "media_use_external_ip",
    "media_nat_1_to_1_ip", "media_timeout", "media_timeout_initial", "symmetric_rtp",
    "ignore_local_addr_in_sdp", "codecs", "hide_inbound_port", "add_record_route", "audio_dtmf",
    "enable_jitter_buffer", "enable_opus", "opus", "jaeger_url",
}  # fmt: skip


def load_yaml(rel: str) -> list:
    return [d for d in yaml.safe_load_all((INFRA / rel).read_text()) if d is not None]


def settings_env() -> set[str]:
    from dataclasses import fields

    from voice_agent.settings import Settings

    return {f.metadata["env"] for f in fields(Settings)}


def k8s_quantity(q: str | int) -> int:
    """Bytes of a Kubernetes memory quantity (Ki/Mi/Gi binary, k/M/G decimal)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, f"not a memory quantity: {q!r}"
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3,
             "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2)]  # fmt: skip
    return int(float(m.group(1)) * scale)


def compose_bytes(q: str | int) -> int:
    """Bytes of a compose memory value (docker units b/k/m/g are binary)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bkmg])?b?", str(q).lower())
    assert m, f"not a compose memory value: {q!r}"
    return int(
        float(m.group(1)) * {None: 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2)]
    )


def serve_args(command: list[str]):
    """The `qwen3-tts serve` command line, parsed by the CLI's own parser."""
    from qwen3_tts_engine.cli import build_parser

    assert command[:2] == ["qwen3-tts", "serve"], command
    try:
        return build_parser().parse_args(command[1:])
    except SystemExit:
        pytest.fail(f"qwen3-tts rejects {shlex.join(command)} (its error is printed above)")


def policy_for(args):
    from qwen3_tts_engine.cli import engine_config

    return engine_config(args).governor.policy


@functools.cache
def real_size_tensors():
    """The real 0.6B architecture's parameter shapes (mlx-audio's modules, no weight evaluated)."""
    from qwen3_tts_engine.bench.memory import real_size_tensors

    return real_size_tensors()


def compute_dtype(args) -> str | None:
    """The dtype the talker computes in: auto is float32 on mlx's CPU backend
    (worker/loading.resolve_compute_dtype), the backend of the Linux images infra/ deploys;
    weights (None) is the weights' own dtype."""
    return {"auto": "float32", "weights": None}.get(args.compute_dtype, args.compute_dtype)


def engine_memory(args):
    """The engine a `qwen3-tts serve` command line runs, by the footprint model
    (models/memory_plan.py): the real 0.6B's weights per rung of its ladder (recipes, vocoder
    dtype, compute dtype), the measured worker runtime, the server process and the spare."""
    from qwen3_tts_engine.models.memory_plan import EngineMemory, rung_memory, weight_bytes

    root, vocoder, layers = real_size_tensors()
    rungs = [rung_memory(v, weight_bytes(root, vocoder, v, layers, compute_dtype(args)))
             for v in policy_for(args).ladder]  # fmt: skip
    return EngineMemory(rungs, spare_worker=args.spare_worker)


def check_engine_memory(limit: int, args, request: int | None = None) -> None:
    """The memory limit the governor reads (and the request, where there is one) fits the
    ladder, by the footprint model and the governor's own decisions (governor/policy.py):
    - requests cover the top rung while it speaks (with the server and the spare), and while a
      full batch (`--max-batch` streams) speaks as `qwen3-tts bench memory` measured it;
    - `--max-batch` streams at the frame cap fit under the downgrade watermark with
      `memory_plan.HEADROOM_BYTES` to spare (admission's budget holds them: no wait, no swap);
    - the top rung loads below the critical watermark and speaks below the downgrade one;
    - every one-rung swap down is make-before-break while the old rung speaks, with room left
      for IN_FLIGHT_SECONDS of KV cache in each of `--max-batch` streams;
    - after a swap down, the idle engine climbs back (below the upgrade watermark, and the
      larger rung fits);
    - the smallest rung is not under pressure itself."""
    from qwen3_tts_engine.config import worker_budget
    from qwen3_tts_engine.governor.memory import MemoryReading
    from qwen3_tts_engine.governor.policy import MAKE_BEFORE_BREAK, PolicyState, choose_mode, decide
    from qwen3_tts_engine.models.memory_plan import BATCH, real_stream_layout
    from qwen3_tts_engine.protocol import Limits

    policy = policy_for(args)
    ladder = list(policy.ladder)
    start = args.variant[0] if args.variant else ladder[0]
    assert start == ladder[0], "the engine should start on the ladder's top rung"
    em = engine_memory(args)
    # each rung at its largest (loading or speaking): the governor's own footprints are the RSS it
    # read after warm-up and at swaps, which a loading or speaking worker exceeds
    footprints = {r.variant: r.largest for r in em.rungs}

    def at(used: int) -> MemoryReading:
        return MemoryReading("manual", limit, used)

    need = {r.variant: r.mb for r in em.rungs}
    layout = real_stream_layout(ladder[0], compute_dtype(args))
    batch = BATCH.speaking * args.max_batch // BATCH.streams  # the measured batch, per stream
    if request is not None:
        assert request >= em.request(), (
            f"requests {request / MB:.0f} MB < {em.request() / MB:.0f} MB: {need}"
        )
        assert request >= em.settled(0) + batch, (
            f"requests {request / MB:.0f} MB < {(em.settled(0) + batch) / MB:.0f} MB: a full "
            "batch speaking (bench memory)"
        )
    at_cap = layout.batch_bytes([Limits.max_new_tokens] * args.max_batch)
    enough = em.limit_for_streams(0, at_cap, policy.downgrade_at)
    assert limit >= enough, (
        f"{args.max_batch} streams at the {Limits.max_new_tokens}-frame cap ({at_cap / MB:.0f} MB) "
        f"need a limit of {enough / 2**20:.0f} MiB ({need})"
    )
    # admission's own budget (`serve --stream-memory-mb auto`) lets them all start
    streams_budget = worker_budget(limit, policy, args.spare_worker) - (em.settled(0) - em.others())
    assert streams_budget >= at_cap, f"admission would hold streams: {streams_budget / MB:.0f} MB"
    assert em.starting(0) < policy.critical_at * limit, f"the top rung's load is critical: {need}"
    assert em.serving(0) < policy.downgrade_at * limit, (
        f"the top rung would downgrade at once: {need}"
    )
    assert em.serving(len(ladder) - 1) < policy.downgrade_at * limit, (
        "even the smallest rung is under pressure"
    )
    in_flight = layout.batch_bytes([IN_FLIGHT_SECONDS * 25 // 2] * args.max_batch)
    for i, (big, small) in enumerate(zip(ladder, ladder[1:], strict=False)):
        swap = em.swap_bytes(i)
        enough = f"a limit of {(swap + in_flight) / policy.make_before_break_below / 2**20:.0f} MiB ({need})"
        assert choose_mode(policy, at(em.serving(i)), footprints[small]) == MAKE_BEFORE_BREAK, (
            f"{big}->{small} is not make-before-break: {swap / MB:.0f} MB > "
            f"{policy.make_before_break_below} x {limit / MB:.0f} MB; needs {enough}")  # fmt: skip
        assert swap + in_flight <= policy.make_before_break_below * limit, (
            f"{big}->{small}: {swap / MB:.0f} MB leaves less than {in_flight / MB:.0f} MB for the "
            f"streams in flight; needs {enough}")  # fmt: skip
        # idle on the smaller rung, the governor climbs back
        idle = at(em.settled(i + 1))
        _, state = decide(policy, PolicyState(), idle, small, footprints, 0.0)
        up, _ = decide(policy, state, idle, small, footprints, policy.upgrade_hold_s + 1)
        assert up is not None and up.target == big, (
            f"an idle engine on {small} stays there: {state.note}"
        )


def workspace_members() -> dict[str, Path]:
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    out = {}
    for member in root["tool"]["uv"]["workspace"]["members"]:
        project = tomllib.loads((REPO / member / "pyproject.toml").read_text())["project"]
        out[project["name"]] = REPO / member
    return out


def console_scripts() -> set[str]:
    scripts = set()
    for path in workspace_members().values():
        project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
        scripts |= set(project.get("scripts", {}))
    return scripts


# -- every file ---------------------------------------------------------------------------------


def test_every_infra_file_exists_and_parses():
    for rel in EXPECTED:
        assert (INFRA / rel).is_file(), f"infra/{rel} is missing"
    yamls = sorted(INFRA.rglob("*.yaml")) + sorted(INFRA.rglob("*.yml"))
    jsons = sorted(INFRA.rglob("*.json"))
    assert len(yamls) >= 6 and len(jsons) >= 2
    for path in yamls:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path
    for path in jsons:
        assert isinstance(json.loads(path.read_text()), dict), path


def test_paths_named_in_the_readmes_exist():
    for readme in (REPO / "README.md", INFRA / "README.md", INFRA / "sip" / "README.md"):
        for rel in re.findall(r"`(infra/[\w./-]+)`", readme.read_text()):
            assert (REPO / rel.rstrip("/")).exists(), f"{readme.name} names {rel}, which is missing"


# -- LiveKit server -----------------------------------------------------------------------------


def test_livekit_config_shape():
    (conf,) = load_yaml("livekit/livekit.yaml")
    assert "keys" not in conf and "key_file" not in conf, (
        "keys come from LIVEKIT_KEYS, not the file"
    )
    assert isinstance(conf["port"], int)
    rtc = conf["rtc"]
    assert isinstance(rtc["tcp_port"], int) and isinstance(rtc["udp_port"], int)
    assert set(conf) <= {"port", "bind_addresses", "rtc", "redis", "keys", "room", "logging",
                         "webhook", "prometheus_port", "node_selector", "turn", "region"}  # fmt: skip
    assert re.fullmatch(r"[\w.-]+:\d+", conf["redis"]["address"])


@pytest.fixture(scope="module")
def livekit_binary():
    binary = find_binary()
    if binary is None:
        pytest.skip("no livekit-server binary: run scripts/install_livekit_server.sh")
    return binary


def _ports(binary: Path, config: Path) -> str:
    env = {**os.environ, "LIVEKIT_KEYS": "placeholderkey: placeholdersecretplaceholdersecret"}
    out = subprocess.run([str(binary), "ports", "--config", str(config)], env=env, timeout=30,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout + out.stderr


def test_livekit_server_parses_the_config_strictly(livekit_binary, tmp_path):
    (conf,) = load_yaml("livekit/livekit.yaml")
    out = _ports(livekit_binary, INFRA / "livekit" / "livekit.yaml")
    assert "could not" not in out and f"{conf['port']} - HTTP service" in out, out
    assert f"{conf['rtc']['tcp_port']} - ICE/TCP" in out, out
    # The check is real: the same binary rejects an unknown key.
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**conf, "no_such_key": 1}))
    assert "field no_such_key not found" in _ports(livekit_binary, bad)


def test_livekit_server_boots_with_the_config(livekit_binary, tmp_path):
    """The deployment's config, minus Redis and with loopback ports, serves HTTP."""
    (conf,) = load_yaml("livekit/livekit.yaml")
    conf.pop("redis")
    conf.pop("prometheus_port", None)
    port = free_port()
    conf.update(port=port, bind_addresses=["127.0.0.1"])
    conf["rtc"].update(tcp_port=0, udp_port=free_udp_port(), node_ip="127.0.0.1",
                       use_external_ip=False, enable_loopback_candidate=True,
                       interfaces={"includes": ["lo"]}, ips={"includes": ["127.0.0.1/32"]})  # fmt: skip
    config = tmp_path / "livekit.yaml"
    config.write_text(yaml.safe_dump(conf))
    log = tmp_path / "livekit-server.log"
    env = {**os.environ, "LIVEKIT_KEYS": "placeholderkey: placeholdersecretplaceholdersecret"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen([str(livekit_binary), "--config", str(config)], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    server = LiveKitServer(f"ws://127.0.0.1:{port}", "placeholderkey", "x", proc, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"livekit-server exited:\n{server.log_tail()}"
            try:
                if httpx.get(server.http_url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no answer:\n{server.log_tail()}"
            time.sleep(0.2)
    finally:
        stop_server(server)


# -- SIP ----------------------------------------------------------------------------------------


def test_sip_bridge_config_keys():
    (conf,) = load_yaml("sip/sip.yaml")
    assert set(conf) <= SIP_CONFIG_KEYS, set(conf) - SIP_CONFIG_KEYS
    assert "redis" in conf, "the bridge refuses to start without redis"
    assert not {"api_key", "api_secret"} & set(conf), "credentials come from the environment"
    (lk,) = load_yaml("livekit/livekit.yaml")
    assert conf["redis"]["address"] == lk["redis"]["address"], "bridge and server share one Redis"
    assert re.fullmatch(r"\d+-\d+", conf["rtp_port"])


def test_sip_trunk_and_dispatch_rule_parse_into_livekit_protobufs():
    from livekit.protocol.sip import CreateSIPDispatchRuleRequest, CreateSIPInboundTrunkRequest

    trunk = ParseDict(json.loads((INFRA / "sip/inbound-trunk.json").read_text()),
                      CreateSIPInboundTrunkRequest())  # fmt: skip
    assert trunk.trunk.name and (trunk.trunk.numbers or trunk.trunk.allowed_addresses)
    assert not trunk.trunk.auth_password, "no secrets in the repository"
    rule = ParseDict(json.loads((INFRA / "sip/dispatch-rule.json").read_text()),
                     CreateSIPDispatchRuleRequest())  # fmt: skip
    assert rule.dispatch_rule.rule.WhichOneof("rule") is not None
    # The worker registers without an agent name (automatic dispatch): naming one here would
    # leave SIP rooms without an agent.
    assert not any(a.agent_name for a in rule.dispatch_rule.room_config.agents)
    # ParseDict is strict: a misspelt field is an error, so the parses above mean something.
    with pytest.raises(ParseError):
        ParseDict({"trunk": {"numbrs": ["+1"]}}, CreateSIPInboundTrunkRequest())


# -- Dockerfile ---------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (INFRA / "docker/agent.Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_targets() -> set[str]:
    return {rest.split()[-1] for word, rest in dockerfile_instructions()
            if word == "FROM" and " AS " in rest.upper()}  # fmt: skip


def test_dockerfile_references_what_the_repository_has():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim AS base")
    members = workspace_members()
    for word, rest in instructions:
        if word == "COPY" and "--from" not in rest:
            *sources, _dest = shlex.split(rest)
            for src in sources:
                assert (REPO / src.rstrip("/")).exists(), f"COPY {src}: not in the repository"
        if word == "RUN" and "uv sync" in rest:
            assert "--frozen" in rest, "install exactly uv.lock"
            package = re.search(r"--package (\S+)", rest).group(1)
            assert package in members, f"{package} is not a workspace member"
            for extra in re.findall(r"--extra (\S+)", rest):
                project = tomllib.loads((members[package] / "pyproject.toml").read_text())
                assert extra in project["project"]["optional-dependencies"], (package, extra)
    assert (REPO / "uv.lock").is_file()
    # The uv version matches the one scripts/bootstrap.sh installs.
    pinned = re.search(r'UV_VERSION="([^"]+)"', (REPO / "scripts/bootstrap.sh").read_text()).group(
        1
    )
    assert any(f"uv=={pinned}" in rest for word, rest in instructions if word == "RUN")
    # Exec-form CMDs (the process gets SIGTERM itself) that run a console script of the workspace.
    cmds = [json.loads(rest) for word, rest in instructions if word == "CMD"]
    assert cmds and all(cmd[0] in console_scripts() for cmd in cmds)
    assert ["voice-agent", "start"] in cmds
    assert {"agent", "tts-engine"} <= dockerfile_targets()


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's own instructions, by name."""
    stages: dict[str, list[tuple[str, str]]] = {}
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        else:
            current.append((word, rest))
    return stages


def image_user() -> tuple[int, str]:
    """The uid the images run as, and its home (where the caches live)."""
    useradd = next(
        rest for word, rest in dockerfile_stages()["base"] if word == "RUN" and "useradd" in rest
    )
    uid = int(re.search(r"useradd --uid (\d+)", useradd).group(1))
    home = re.search(r"--home-dir (\S+)", useradd).group(1)
    return uid, home


def test_images_run_as_an_unprivileged_user():
    uid, home = image_user()
    assert uid != 0
    stages = dockerfile_stages()
    for target in ("agent", "tts-engine"):
        words = [w for w, _ in stages[target]]
        users = [rest for w, rest in stages[target] if w == "USER"]
        assert users and users[-1] == f"{uid}:{uid}", (
            target,
            users,
        )  # numeric: runAsNonRoot checks it
        assert words.index("USER") < words.index("CMD"), target
        assert ("ENV", f"HOME={home}") in stages[target], target
    # the caches exist in the image and belong to that user (a fresh volume copies the ownership)
    (setup,) = [rest for w, rest in stages["base"] if w == "RUN" and "useradd" in rest]
    for cache in ("huggingface", "qwen3-tts", "qwen3-voice-agent"):
        assert f"{home}/.cache/{cache}" in setup
    assert f"chown -R app:app {home}/.cache" in setup


# -- compose ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose():
    (doc,) = load_yaml("compose.yaml")
    return doc


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def tts_engines(services: dict) -> dict[str, dict]:
    return {name: s for name, s in services.items()
            if isinstance(s.get("command"), list) and s["command"][:2] == ["qwen3-tts", "serve"]}  # fmt: skip


def replicas(service: dict) -> int:
    return int(service.get("deploy", {}).get("replicas", 1))


def test_compose_services_and_dependencies(compose):
    services = compose["services"]
    assert {"redis", "livekit", "sip", "agent", "llm"} <= set(services)
    assert services["livekit"]["image"].startswith("livekit/livekit-server:")
    assert services["sip"]["image"].startswith("livekit/sip")
    assert sum(replicas(s) for s in tts_engines(services).values()) >= 2, "two engines at least"
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        deps = service.get("depends_on", {})
        for dep, how in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
            assert dep in services, f"{name} depends on unknown {dep}"
            if how.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep}'s missing healthcheck"
                )
        if "build" in service:
            build = service["build"]
            assert (INFRA / build["context"] / build["dockerfile"]).is_file()
            assert build["target"] in dockerfile_targets()
        for volume in service.get("volumes", []):
            src, target = volume.split(":")[:2]
            if src.startswith("."):
                assert (INFRA / src).is_file(), f"{name} mounts missing {src}"
            else:
                assert src in compose.get("volumes", {}), f"{name}: undeclared volume {src}"


def test_compose_agent_wiring(compose):
    services = compose["services"]
    agent = services["agent"]
    env = env_of(agent)
    assert agent["command"] == ["voice-agent", "start"]
    assert agent["deploy"]["replicas"] >= 2
    unknown = set(env) - settings_env() - OTHER_ENV
    assert not unknown, f"not voice-agent settings (typos?): {unknown}"
    for secret in ("LIVEKIT_API_KEY", "LIVEKIT_API_SECRET"):
        assert env[secret].startswith("${"), f"{secret} must come from the environment"

    # TTS: every URL names an engine service, on the port its command serves, on all interfaces;
    # a service with replicas resolves to an address per replica (each an engine to the plugin).
    urls = [urlparse(u.strip()) for u in env["TTS_URL"].split(",")]
    engines = tts_engines(services)
    assert sum(replicas(engines.get(u.hostname, {})) for u in urls) >= 2, "two engines: failover"
    for url in urls:
        assert url.hostname in engines, f"TTS_URL host {url.hostname} is not an engine service"
        engine = engines[url.hostname]
        args = serve_args(engine["command"])
        assert url.port == args.port and args.host == "0.0.0.0"
        check = " ".join(engine["healthcheck"]["test"])
        assert f"127.0.0.1:{args.port}/ready" in check, "healthcheck on the engine's /ready"
        check_engine_memory(compose_bytes(engine["deploy"]["resources"]["limits"]["memory"]), args)
        assert url.hostname in agent["depends_on"]
    assert env.get("TTS_PROTOCOL", "qwen3-tts") == "qwen3-tts"

    # LLM: an OpenAI-compatible base URL (…/v1) on the llm service's port.
    llm_url = urlparse(env["LLM_BASE_URL"])
    assert llm_url.hostname in services and llm_url.path == "/v1"
    llm_cmd = services[llm_url.hostname]["command"]
    assert llm_cmd[llm_cmd.index("--port") + 1] == str(llm_url.port)
    assert env["LLM_MODEL"] == llm_cmd[llm_cmd.index("--model") + 1]

    # LiveKit: host-networked server reached through host.docker.internal on livekit.yaml's port.
    (lk,) = load_yaml("livekit/livekit.yaml")
    lk_url = urlparse(env["LIVEKIT_URL"])
    assert lk_url.scheme in ("ws", "wss") and lk_url.port == lk["port"]
    if lk_url.hostname == "host.docker.internal":
        assert services["livekit"]["network_mode"] == "host"
        assert "host.docker.internal:host-gateway" in agent["extra_hosts"]
    else:
        assert lk_url.hostname in services


def test_compose_engines_need_a_key_and_images_write_only_caches(compose):
    from qwen3_tts_engine.serving.auth import exposure_problem

    uid, home = image_user()
    services = compose["services"]
    for name, service in {**tts_engines(services), "agent": services["agent"]}.items():
        key = env_of(service)["QWEN3_TTS_API_KEY"]
        assert key.startswith("${QWEN3_TTS_API_KEY:?"), f"{name}: the key is required, got {key}"
        assert service["read_only"] is True and service["tmpfs"] == ["/tmp"], name
        assert service["cap_drop"] == ["ALL"], name
        for volume in service.get("volumes", []):
            src, target = volume.split(":")[:2]
            assert src.startswith(".") or target.startswith(f"{home}/.cache/"), (name, volume)
    for name, engine in tts_engines(services).items():
        args = serve_args(engine["command"])
        assert not args.insecure_no_auth, name
        # with the (required) key set, the engine's own check lets it listen on every interface
        assert exposure_problem(args.host, None, None) and not exposure_problem(
            args.host, "key", None
        )


def test_compose_livekit_sip_and_redis(compose):
    services = compose["services"]
    (lk,) = load_yaml("livekit/livekit.yaml")
    (sip,) = load_yaml("sip/sip.yaml")
    livekit = services["livekit"]
    mounts = dict(v.split(":")[:2] for v in livekit["volumes"])
    # the server starts on livekit.yaml plus the keeper's webhook, signed with the API key
    (script,) = livekit["command"]
    assert f"cp {mounts['./livekit/livekit.yaml']} /tmp/livekit.yaml" in script
    assert "--config /tmp/livekit.yaml" in script and "$$LIVEKIT_API_KEY" in script
    keeper = services["keeper"]
    published = {p.rsplit(":", 1)[0] for p in keeper["ports"]}
    assert "127.0.0.1:8400" in published and "http://127.0.0.1:8400/webhook" in script
    assert (
        keeper["command"] == ["voice-agent", "keeper"] and env_of(keeper)["KEEPER_PORT"] == "8400"
    )
    assert env_of(services["agent"])["KEEPER_URL"] == "http://keeper:8400"
    assert "LIVEKIT_KEYS" in env_of(livekit) and env_of(livekit)["LIVEKIT_API_KEY"].startswith("${")
    bridge_env = env_of(services["sip"])
    mounts = dict(v.split(":")[:2] for v in services["sip"]["volumes"])
    assert mounts["./sip/sip.yaml"] == bridge_env["SIP_CONFIG_FILE"]
    assert urlparse(bridge_env["LIVEKIT_WS_URL"]).port == lk["port"]
    for secret in ("LIVEKIT_API_KEY", "LIVEKIT_API_SECRET"):
        assert bridge_env[secret].startswith("${")
    # Host-networked server and bridge reach Redis where compose publishes it.
    published = {
        p.rsplit(":", 2)[0] + ":" + p.rsplit(":", 2)[1] for p in services["redis"]["ports"]
    }
    assert lk["redis"]["address"] in published and sip["redis"]["address"] in published
    assert services["sip"]["network_mode"] == "host"


# -- Kubernetes ---------------------------------------------------------------------------------


def k8s_objects() -> dict[tuple[str, str], dict]:
    objs = {}
    for rel in ("k8s/agent-worker.yaml", "k8s/tts-engine.yaml", "k8s/call-keeper.yaml"):
        for doc in load_yaml(rel):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), (rel, doc.get("kind"))
            assert doc["metadata"]["name"], rel
            objs[(doc["kind"], doc["metadata"]["name"])] = doc
    return objs


def container(objs, name: str) -> dict:
    (c,) = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return c


def test_k8s_object_shapes():
    objs = k8s_objects()
    for (kind, name), obj in objs.items():
        if kind == "Deployment":
            spec = obj["spec"]
            labels = spec["template"]["metadata"]["labels"]
            assert spec["selector"]["matchLabels"].items() <= labels.items(), name
            for c in spec["template"]["spec"]["containers"]:
                res = c["resources"]
                for key in ("memory", "cpu"):
                    assert key in res["limits"] and key in res["requests"], (name, key)
                assert k8s_quantity(res["requests"]["memory"]) <= k8s_quantity(
                    res["limits"]["memory"]
                )
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    if probe in c:
                        assert c[probe]["httpGet"]["port"] in ports, (name, probe)
        if kind == "Service":
            target = objs[("Deployment", name)]
            labels = target["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"].items() <= labels.items()
            names = {p["name"] for p in container(objs, name)["ports"]}
            assert all(p["targetPort"] in names for p in obj["spec"]["ports"])


def test_k8s_workers_send_heartbeats_to_the_call_keeper():
    objs = k8s_objects()
    url = urlparse(objs[("ConfigMap", "agent-worker")]["data"]["KEEPER_URL"])
    service = objs[("Service", url.hostname)]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    keeper = container(objs, url.hostname)
    env = {e["name"]: e.get("value") for e in keeper["env"]}
    assert keeper["args"] == ["voice-agent", "keeper"] and env["KEEPER_HOST"] == "0.0.0.0"
    assert int(env["KEEPER_PORT"]) in {p["containerPort"] for p in keeper["ports"]}
    assert {"secretRef": {"name": "livekit-credentials"}} in keeper["envFrom"]


def test_k8s_tts_engine_probes_metrics_and_memory():
    objs = k8s_objects()
    c = container(objs, "tts-engine")
    args = serve_args(c["args"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.host == "0.0.0.0" and ports["http"] == args.port
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    notes = objs[("Deployment", "tts-engine")]["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == args.port
    # requests: what the pod holds while the top rung speaks, for the scheduler
    check_engine_memory(k8s_quantity(c["resources"]["limits"]["memory"]), args,
                        request=k8s_quantity(c["resources"]["requests"]["memory"]))  # fmt: skip


def test_k8s_agent_worker_drain_config_and_urls():
    from livekit.agents.worker import DRAIN_TIMEOUT

    objs = k8s_objects()
    deployment = objs[("Deployment", "agent-worker")]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= DRAIN_TIMEOUT, "SIGKILL would cut calls"
    assert "preStop" not in pod["containers"][0].get("lifecycle", {}), "SIGTERM drains by itself"
    c = container(objs, "agent-worker")
    assert c["args"] == ["voice-agent", "start"]
    config_maps = [e["configMapRef"]["name"] for e in c["envFrom"] if "configMapRef" in e]
    for name in config_maps:
        data = objs[("ConfigMap", name)]["data"]
        unknown = set(data) - settings_env() - OTHER_ENV
        assert not unknown, f"not voice-agent settings (typos?): {unknown}"
        assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"
        service = objs[("Service", "tts-engine")]
        for url in data["TTS_URL"].split(","):
            u = urlparse(url.strip())
            assert u.hostname == service["metadata"]["name"]
            assert u.port in {p["port"] for p in service["spec"]["ports"]}
    assert any(e.get("secretRef", {}).get("name") == "livekit-credentials" for e in c["envFrom"])
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == 8081  # livekit-agents
    # The Prometheus annotation points at METRICS_PORT.
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert (
        notes["prometheus.io/port"] == objs[("ConfigMap", config_maps[0])]["data"]["METRICS_PORT"]
    )


def test_k8s_pods_run_unprivileged_with_the_engine_key():
    uid, home = image_user()
    objs = k8s_objects()
    for name in ("tts-engine", "agent-worker"):
        pod = objs[("Deployment", name)]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid == pod["securityContext"]["fsGroup"]
        c = container(objs, name)
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {f"{home}/.cache", "/tmp"}, (name, mounts)
        env = {e["name"]: e for e in c.get("env", [])}
        ref = env["QWEN3_TTS_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "qwen3-tts", "key": "api-key"}, (name, ref)  # not optional
    args = serve_args(container(objs, "tts-engine")["args"])
    assert not args.insecure_no_auth


def test_k8s_kustomization():
    (k,) = load_yaml("k8s/kustomization.yaml")
    assert k["kind"] == "Kustomization"
    for rel in k["resources"]:
        assert (INFRA / "k8s" / rel).is_file(), rel
    images = {c["image"].split(":")[0] for rel in k["resources"]
              for d in load_yaml(f"k8s/{rel}") if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}  # fmt: skip
    assert images == {i["name"] for i in k["images"]}


def test_k8s_engines_behind_a_headless_service_and_an_optional_inference_pool():
    """The agent's TTS URL names a headless Service (an address per ready engine pod); the
    llm-d / Gateway API route selects the same pods on the same port, and stays out of the
    default kustomization (it needs CRDs)."""
    objs = k8s_objects()
    service = objs[("Service", "tts-engine")]
    assert service["spec"]["clusterIP"] == "None"
    pods = objs[("Deployment", "tts-engine")]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pods.items()
    port = serve_args(container(objs, "tts-engine")["args"]).port
    pool, route, epp = load_yaml("k8s/tts-inferencepool.yaml")
    assert (
        pool["kind"] == "InferencePool" and pool["apiVersion"] == "inference.networking.k8s.io/v1"
    )
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    assert pool["spec"]["endpointPickerRef"]["name"]
    speech, reads = route["spec"]["rules"]
    assert speech["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                      "name": pool["metadata"]["name"]}]  # fmt: skip
    assert speech["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/audio/speech"}}]
    # the plugin's other reads go to the engines' Service: behind the route, status answers and
    # `text_input="auto"` finds the socket (a 404 there would silently mean sentences)
    assert reads["backendRefs"] == [{"kind": "Service", "name": "tts-engine", "port": port}]

    def routed(path: str) -> dict | None:
        for rule in route["spec"]["rules"]:
            for m in rule["matches"]:
                kind, value = m["path"]["type"], m["path"]["value"]
                if path == value or (kind == "PathPrefix" and path.startswith(value + "/")):
                    return rule
        return None

    from livekit.plugins.qwen3_tts import fleet, protocol

    for path in ("/v1/audio/speech", protocol.SPEECH_STREAM_PATH):
        assert routed(path) is speech, path
    for path in ("/ready", fleet.LOAD_PATH, "/get_load", protocol.STATUS_PATH):
        assert routed(path) is reads, path
    config = yaml.safe_load(next(iter(epp["data"].values())))
    assert config["kind"] == "EndpointPickerConfig"
    (k,) = load_yaml("k8s/kustomization.yaml")
    assert "tts-inferencepool.yaml" not in k["resources"], "it needs CRDs: applied by hand"
