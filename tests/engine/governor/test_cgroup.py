"""The governor under real memory pressure: the engine runs in a child memory cgroup with a limit,
a ballast process in the same cgroup grows, and the governor must step down before the kernel
kills anything. Needs root and a writable memory cgroup (v1 or v2); skipped, with the reason
printed, elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from qwen3_tts_engine.governor.memory import cgroup_dirs, parse_limit
from qwen3_tts_engine.protocol import FRAME_SAMPLES, HEADER_VARIANT
from tests.support.engine_process import free_port

pytestmark = pytest.mark.slow
MB = 1 << 20
LIMIT = 1300 * MB
DOWNGRADE_AT = 0.75
# the pressure each step down starts from: with any worker's footprint (>= 91 MB) past the
# policy's 0.95 for both at once, so each swap breaks before it makes
PRESSURE = 0.88

BALLAST = """
import sys
blocks = []
for line in sys.stdin:
    blocks.append(b"\\x01" * (int(line) << 20))  # written, so resident
    print(sum(map(len, blocks)) >> 20, flush=True)
"""


class Cgroup:
    """A child memory cgroup of our own (v1: memory.limit_in_bytes; v2: memory.max)."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind, self.path = kind, path
        v1 = kind == "cgroup-v1"
        self.limit_file = path / ("memory.limit_in_bytes" if v1 else "memory.max")
        self.usage_file = path / ("memory.usage_in_bytes" if v1 else "memory.current")

    @classmethod
    def create(cls, limit: int) -> Cgroup:
        """A fresh child of this process's memory cgroup, or pytest.skip with the reason."""

        def skip(reason: str):
            print(f"SKIP test_governor_cgroup: {reason}")
            pytest.skip(reason)

        if sys.platform != "linux" or os.geteuid() != 0:
            skip("needs root on Linux to create a memory cgroup")
        try:
            found = cgroup_dirs(Path("/proc/self/cgroup").read_text(),
                                Path("/proc/self/mountinfo").read_text())  # fmt: skip
        except OSError as e:
            skip(f"cannot read /proc/self/cgroup or mountinfo: {e}")
        errors = []
        for kind in ("cgroup-v1", "cgroup-v2"):  # v1 first: its memory controller is its own
            if kind not in found:
                continue
            path = found[kind][0] / f"qwen3-tts-governor-test-{os.getpid()}"
            try:
                path.mkdir()
            except OSError as e:
                errors.append(f"{kind}: mkdir {path}: {e}")
                continue
            cg = cls(kind, path)
            try:
                cg.limit_file.write_text(str(limit))
                if parse_limit(cg.limit_file.read_text()) is None:
                    raise OSError("the limit did not stick")
                return cg
            except OSError as e:
                errors.append(f"{kind}: cannot set a memory limit in {path}: {e}")
                cg.remove()
        skip("no writable memory cgroup: " + ("; ".join(errors) or "no cgroup mounts found"))

    def spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` inside this cgroup (it joins before exec, so its children are in too)."""
        procs = self.path / "cgroup.procs"
        script = f'echo $$ > "{procs}" && exec "$@"'
        return subprocess.Popen(["sh", "-c", script, "sh", *argv], start_new_session=True, **kw)

    def oom_kills(self) -> int:
        name, key = (("memory.oom_control", "oom_kill") if self.kind == "cgroup-v1"
                     else ("memory.events", "oom_kill"))  # fmt: skip
        for line in (self.path / name).read_text().splitlines():
            if line.startswith(key + " "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


BOTTOM = "4bit-emb4-voc16"  # the default ladder's smallest rung


def _mb(rec: dict, when: str, key: str) -> float:
    return rec[f"memory_{when}"][key] / MB


def _swap_line(rec: dict) -> str:
    return (f"swap {rec['from_variant']} -> {rec['to_variant']} ({rec['mode']}, {rec['cause']}) at "
            f"pressure {rec['reading']['pressure']:.3f} in {rec['latency_s']:.2f}s; active worker "
            f"RSS {_mb(rec, 'before', 'active_rss_bytes'):.0f} -> {_mb(rec, 'after', 'active_rss_bytes'):.0f}"
            f" MB, mlx active {_mb(rec, 'before', 'active_mlx_active_bytes'):.0f} -> "
            f"{_mb(rec, 'after', 'active_mlx_active_bytes'):.0f} MB")  # fmt: skip


def test_real_memory_pressure_makes_the_engine_step_down(tiny_checkpoint):
    """bf16 -> 4bit -> the bottom rung as the ballast grows, then one rung up once it is gone."""
    from qwen3_tts_engine.models.variants import resolve
    from qwen3_tts_engine.worker.loading import prepare

    cg = Cgroup.create(LIMIT)
    # Wide talker MLPs: 25 MB of bf16 weights that 4-bit quantization shrinks to 7 MB.
    model = tiny_checkpoint("custom_voice", talker_layers=4, talker_intermediate_size=16384)
    for rung in ("4bit", BOTTOM):
        prepare(resolve(str(model), rung), progress=False)  # quantize here, outside the limit
    port = free_port()
    exe = str(Path(sys.executable).with_name("qwen3-tts"))
    engine = ballast = None
    try:
        engine = cg.spawn([exe, "serve", "--model", str(model), "--port", str(port),
                           "--ladder", f"bf16,4bit,{BOTTOM}", "--allow-unevaluated", f"4bit,{BOTTOM}",
                           "--downgrade-at", str(DOWNGRADE_AT), "--upgrade-at", "0.5",
                           "--downgrade-hold", "0.5", "--upgrade-hold", "1", "--cooldown", "2",
                           "--governor-interval", "0.2"],
                          env={**os.environ, "QWEN3_TTS_LOG_LEVEL": "INFO"})  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=httpx.Timeout(120)) as c:
            deadline = time.monotonic() + 120
            while True:
                assert engine.poll() is None, "the engine exited while starting"
                assert time.monotonic() < deadline, "engine not ready"
                try:
                    if c.get("/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            status = c.get("/v1/engine/status").json()
            g = status["governor"]
            assert g["pressure"]["source"] == cg.kind and g["pressure"]["detail"] == str(cg.path)
            assert (
                g["ladder"] == ["bf16", "4bit", BOTTOM] and g["pressure"]["pressure"] < DOWNGRADE_AT
            )
            fp = status["handlers"][0]["footprint"]  # what the worker's memory is made of
            assert fp["process_bytes"] > fp["talker_bytes"] > 0 and fp["runtime_bytes"] > 0

            def settled(n: int) -> dict:
                g = c.get("/v1/engine/status").json()["governor"]
                while len(g["history"]) < n or g["history"][n - 1]["ok"] is None or g["swapping"] \
                        or g["history"][n - 1]["memory_after"] is None:  # fmt: skip
                    time.sleep(0.1)
                    g = c.get("/v1/engine/status").json()["governor"]
                return g

            def variant(name: str) -> None:  # the operator's pin ("auto" unpins)
                r = c.post("/v1/engine/variant", json={"variant": name})
                assert r.status_code == 200 and r.json()["swap"] is None, r.text

            # Each step down: with the variant pinned (the governor only watches), the ballast
            # grows in 16 MB steps to PRESSURE (or until usage gets close to the limit, which
            # would fail the test rather than OOM-kill); then the pin is lifted and the governor
            # decides on that steady reading, however fast the ballast grew.
            ballast = cg.spawn([sys.executable, "-c", BALLAST], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
            grown = 0
            for n in (1, 2):
                variant(g["active_variant"])
                g = c.get("/v1/engine/status").json()["governor"]
                while (
                    g["pressure"]["pressure"] < PRESSURE
                    and int(cg.usage_file.read_text()) < 0.9 * LIMIT
                ):
                    ballast.stdin.write("16\n")
                    ballast.stdin.flush()
                    grown = int(ballast.stdout.readline())
                    time.sleep(0.05)
                    g = c.get("/v1/engine/status").json()["governor"]
                    assert engine.poll() is None and ballast.poll() is None
                assert (
                    g["pressure"]["pressure"] >= DOWNGRADE_AT
                    and not g["history"][n - 1 :]
                    and g["pinned"]
                ), g
                variant("auto")
                while len(g["history"]) < n and g["swapping"] is None:
                    time.sleep(0.05)
                    g = c.get("/v1/engine/status").json()["governor"]
                    assert engine.poll() is None and ballast.poll() is None
                if n == 1:
                    # A request that arrives during the swap waits for the new variant; it
                    # never fails.
                    r = c.post("/v1/audio/speech", json={"input": "Under pressure.", "voice": "ryan",
                                                         "max_new_tokens": 4, "response_format": "pcm"})  # fmt: skip
                    assert r.status_code == 200 and len(r.content) == 4 * FRAME_SAMPLES * 2
                    assert r.headers[HEADER_VARIANT] == "4bit"
                g = settled(n)
            down = g["history"][:2]
            print(f"ballast {grown} MB")
            for rec in down:
                print(_swap_line(rec))
            r = c.post("/v1/audio/speech", json={"input": "Smallest.", "voice": "ryan",
                                                 "max_new_tokens": 4, "response_format": "pcm"})  # fmt: skip
            assert r.status_code == 200 and r.headers[HEADER_VARIANT] == BOTTOM

            # The ballast is gone: once the pressure has stayed low, one rung up.
            _stop(ballast)
            g = settled(3)
            up = g["history"][2]
            print(f"ballast released; {_swap_line(up)}; oom kills {cg.oom_kills()}")

        assert [(r["from_variant"], r["to_variant"], r["ok"]) for r in g["history"]] == [
            ("bf16", "4bit", True), ("4bit", BOTTOM, True), (BOTTOM, "4bit", True)]  # fmt: skip
        for rec in down:
            assert (
                rec["reading"]["source"] == cg.kind and rec["reading"]["pressure"] >= DOWNGRADE_AT
            )
            # Both workers would not have fit: the old one was stopped before the new one loaded.
            assert rec["mode"] == "break-before-make"
            before, after = rec["memory_before"], rec["memory_after"]
            assert after["active_rss_bytes"] < before["active_rss_bytes"]
        # bf16 -> 4bit shrinks the talker; 4bit -> the bottom the text embedding and the vocoder.
        assert down[0]["memory_after"]["active_mlx_active_bytes"] < \
            down[0]["memory_before"]["active_mlx_active_bytes"] - 15 * MB  # fmt: skip
        assert down[1]["memory_after"]["active_mlx_active_bytes"] < \
            down[1]["memory_before"]["active_mlx_active_bytes"] - 15 * MB  # fmt: skip
        assert up["direction"] == "up" and up["cause"] == "recovered"
        assert (
            up["memory_after"]["active_mlx_active_bytes"]
            > up["memory_before"]["active_mlx_active_bytes"]
        )
        assert cg.oom_kills() == 0 and engine.poll() is None
    finally:
        _stop(ballast)
        _stop(engine)
        cg.remove()
