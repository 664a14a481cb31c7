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

from .engine_process import free_port

pytestmark = pytest.mark.slow
MB = 1 << 20
LIMIT = 1300 * MB
DOWNGRADE_AT = 0.75

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


def test_real_memory_pressure_makes_the_engine_step_down(tiny_checkpoint):
    from qwen3_tts_engine.models.loading import prepare
    from qwen3_tts_engine.models.variants import resolve

    cg = Cgroup.create(LIMIT)
    # Wide talker MLPs: 25 MB of bf16 weights that 4-bit quantization shrinks to 7 MB.
    model = tiny_checkpoint("custom_voice", talker_layers=4, talker_intermediate_size=16384)
    prepare(resolve(str(model), "4bit"), progress=False)  # quantize here, outside the limit
    port = free_port()
    exe = str(Path(sys.executable).with_name("qwen3-tts"))
    engine = ballast = None
    try:
        engine = cg.spawn([exe, "serve", "--model", str(model), "--port", str(port),
                           "--ladder", "bf16,4bit", "--allow-unevaluated", "4bit", "--downgrade-at", str(DOWNGRADE_AT),
                           "--upgrade-at", "0.2", "--downgrade-hold", "0.5", "--cooldown", "60",
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
            g = c.get("/v1/engine/status").json()["governor"]
            assert g["pressure"]["source"] == cg.kind and g["pressure"]["detail"] == str(cg.path)
            assert g["ladder"] == ["bf16", "4bit"] and g["pressure"]["pressure"] < DOWNGRADE_AT

            # The ballast grows in 16 MB steps until the governor acts (or usage gets close to
            # the limit, which would fail the test rather than OOM-kill anything).
            ballast = cg.spawn([sys.executable, "-c", BALLAST], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
            grown = 0
            while not g["history"] and g["swapping"] is None:
                if int(cg.usage_file.read_text()) < 0.9 * LIMIT:
                    ballast.stdin.write("16\n")
                    ballast.stdin.flush()
                    grown = int(ballast.stdout.readline())
                time.sleep(0.05)
                g = c.get("/v1/engine/status").json()["governor"]
                assert engine.poll() is None and ballast.poll() is None
            # A request that arrives during the swap waits for the new variant; it never fails.
            r = c.post("/v1/audio/speech", json={"input": "Under pressure.", "voice": "ryan",
                                                 "max_new_tokens": 4, "response_format": "pcm"})  # fmt: skip
            assert r.status_code == 200 and len(r.content) == 4 * FRAME_SAMPLES * 2
            assert r.headers[HEADER_VARIANT] == "4bit"
            while not g["history"] or g["history"][0]["ok"] is None or g["swapping"]:
                time.sleep(0.1)
                g = c.get("/v1/engine/status").json()["governor"]

        rec = g["history"][0]
        print(f"ballast {grown} MB; swap {rec['from_variant']} -> {rec['to_variant']} "
              f"({rec['mode']}, {rec['cause']}) at pressure {rec['reading']['pressure']:.3f} "
              f"in {rec['latency_s']:.2f}s; active worker RSS {rec['memory_before']['active_rss_bytes'] / MB:.0f}"
              f" -> {rec['memory_after']['active_rss_bytes'] / MB:.0f} MB, mlx active "
              f"{rec['memory_before']['active_mlx_active_bytes'] / MB:.0f} -> "
              f"{rec['memory_after']['active_mlx_active_bytes'] / MB:.0f} MB; oom kills "
              f"{cg.oom_kills()}")  # fmt: skip
        assert rec["ok"] and (rec["from_variant"], rec["to_variant"]) == ("bf16", "4bit")
        assert rec["reading"]["source"] == cg.kind and rec["reading"]["pressure"] >= DOWNGRADE_AT
        # Both workers would not have fit: the old one was stopped before the new one loaded.
        assert rec["mode"] == "break-before-make"
        before, after = rec["memory_before"], rec["memory_after"]
        assert after["active_rss_bytes"] < before["active_rss_bytes"]
        assert after["active_mlx_active_bytes"] < before["active_mlx_active_bytes"] - 15 * MB
        assert cg.oom_kills() == 0 and engine.poll() is None and ballast.poll() is None
    finally:
        _stop(ballast)
        _stop(engine)
        cg.remove()
