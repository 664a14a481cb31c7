"""`qwen3-tts bench blas`: first audio of `qwen3-tts serve` started as a user starts it (a shell
that sourced nothing) against the same server with OpenBLAS preloaded by `LD_PRELOAD` (what
`.venv/openblas.env` used to do for every command), and the BLAS library each worker mapped.

Both servers run side by side; their requests alternate, one at a time, so that both see the
same machine; a third server runs with `QWEN3_TTS_BLAS=reference` (what a clean shell got before
`fast_blas.py`: mlx-cpu's reference BLAS). JSON on stdout; the number that matters is
`first_audio_p50_ratio` (clean ÷ preloaded: 1.0 means the fast path needs no step of the
user's). First audio is the first chunk's arrival; first audible adds the audio's leading silence
(`audio.leading_silence_s`, as Coval's TTS benchmark counts it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from qwen3_tts_engine.audio import leading_silence_s
from qwen3_tts_engine.fast_blas import ENV, openblas_path
from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

QWEN3_TTS = Path(sys.executable).with_name("qwen3-tts")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict[str, str]:
    """What a login shell has: no LD_PRELOAD, no virtual environment, nothing of this process."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"),
            "LANG": "C.UTF-8", "QWEN3_TTS_LOG_LEVEL": "WARNING"}  # fmt: skip


class _Server:
    def __init__(self, name: str, model: str, env: dict[str, str]) -> None:
        self.name, self.port = name, _free_port()
        self.proc = subprocess.Popen([str(QWEN3_TTS), "serve", "--model", model, "--port", str(self.port)],
                                     env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited ({self.proc.returncode})")
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the {self.name} server was not ready after {timeout:.0f} s")

    def worker_blas(self) -> list[str]:
        pid = httpx.get(f"{self.url}/v1/engine/status", timeout=30).json()["handlers"][0]["pid"]
        maps = Path(f"/proc/{pid}/maps").read_text() if sys.platform.startswith("linux") else ""
        libs = {line.split()[-1] for line in maps.splitlines() if line.split()[-1].startswith("/")}
        return sorted(
            lib for lib in libs if "blas" in Path(lib).name.lower() and "numpy" not in lib
        )

    def first_audio(self, frames: int) -> tuple[float, float]:
        """Seconds to the first chunk and to the first audible sample."""
        body = {"input": "Hello, this is a test of the first audio.", "max_new_tokens": frames,
                "response_format": "pcm", "stream": True, "seed": 0}  # fmt: skip
        t0 = time.perf_counter()
        with httpx.stream("POST", f"{self.url}/v1/audio/speech", json=body, timeout=600) as r:
            r.raise_for_status()
            first, pcm = None, bytearray()
            for data in r.iter_raw():
                first = first if first is not None else time.perf_counter() - t0
                pcm += data
        if first is None:
            raise RuntimeError(f"the {self.name} server sent no audio")
        return first, first + leading_silence_s(bytes(pcm[: len(pcm) // 2 * 2]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def run_blas_bench(args: argparse.Namespace) -> int:
    model = args.model or str(default_tiny_checkpoint())
    preload = openblas_path()
    if preload is None:
        print(
            "qwen3-tts: error: no OpenBLAS installed here (Debian: libopenblas0-pthread)",
            file=sys.stderr,
        )
        return 2
    servers = [_Server("clean", model, _clean_env()),
               _Server("ld_preload", model, {**_clean_env(), "LD_PRELOAD": preload}),
               # what a clean shell got before fast_blas.py: mlx-cpu's reference BLAS
               _Server("reference", model, {**_clean_env(), ENV: "reference"})]  # fmt: skip
    try:
        for s in servers:
            s.wait_ready()
        for s in servers:  # warm-up request each (first requests pay one-time costs)
            s.first_audio(args.frames)
        times: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
        for i in range(args.repeats):
            print(f"  repeat {i + 1} of {args.repeats}", file=sys.stderr, flush=True)
            for s in servers[i % len(servers) :] + servers[: i % len(servers)]:  # rotate the order
                times[s.name].append(s.first_audio(args.frames))
        blas = {s.name: s.worker_blas() for s in servers}
    finally:
        for s in servers:
            s.stop()
    p50 = {name: statistics.median(f for f, _ in v) for name, v in times.items()}
    audible = {name: [a for _, a in v] for name, v in times.items()}
    result = {
        "model": model, "frames": args.frames, "repeats": args.repeats,
        "first_audio_s": {name: {"p50": p50[name], "all": [f for f, _ in v]} for name, v in times.items()},
        "first_audible_s": {name: {"p50": statistics.median(v), "all": v} for name, v in audible.items()},
        "first_audio_p50_ratio": p50["clean"] / p50["ld_preload"],
        "reference_over_clean_p50": p50["reference"] / p50["clean"],
        "worker_blas": blas,
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
