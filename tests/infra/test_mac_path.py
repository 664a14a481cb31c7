"""The Apple Silicon path, checked from Linux: bootstrap's macOS branch (platform, Homebrew and
tools injected), the lock installing on macOS arm64 (and x86_64 manylinux) by uv's dry run against
PyPI, the demo's speech through the `say` code path with a stand-in `say`, and what `voice-agent
console` shows while its services download and convert models."""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from voice_agent.harness.speech_assets import choose_speech_tool, read_wav, speech_wav
from voice_agent.services import download_llm, newest_progress
from voice_agent.services.progress import wait_until_ready

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"
UV = REPO / ".cache" / "uv" / "bin" / "uv"
HOMEBREW_URL = "https://raw.githubusercontent.com/Homebrew/install/HEAD/install.sh"

# -- scripts/bootstrap.sh on a Mac, in a dry run ---------------------------------------------------

CORE_UTILS = ("dirname", "ls", "head", "grep", "awk", "cat", "uname")
PYTHON_MAC = 'echo "True arm64"'  # what the bootstrap's probe prints on a Mac's Python 3.12
FOUND = "exit 0"


def _bootstrap(tmp_path: Path, stand_ins: dict[str, str], *, uname: str = "Darwin",
               arch: str = "arm64") -> tuple[int, str, Path]:  # fmt: skip
    """Run a copy of the bootstrap (so the dry run cannot touch this checkout) with a PATH of
    core utilities plus `stand_ins` (name -> shell body): (exit code, its output, that PATH)."""
    root, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (root / "scripts").mkdir(parents=True)
    for name in ("bootstrap.sh", "apt_install.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    bin_dir.mkdir()
    for util in CORE_UTILS:
        os.symlink(shutil.which(util), bin_dir / util)
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!{BASH}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "BOOTSTRAP_DRY_RUN": "1",
           "BOOTSTRAP_UNAME": uname, "BOOTSTRAP_ARCH": arch}  # fmt: skip
    r = subprocess.run([BASH, str(root / "scripts" / "bootstrap.sh")], env=env, text=True,
                       capture_output=True, timeout=60)  # fmt: skip
    assert not (root / ".venv").exists() and not (root / ".cache").exists(), (
        "a dry run changed files"
    )
    return r.returncode, r.stdout + r.stderr, bin_dir


def test_mac_with_homebrew_installs_the_missing_tools_and_no_debian_packages(tmp_path):
    code, out, bin_dir = _bootstrap(tmp_path, {"brew": FOUND, "python3": PYTHON_MAC})
    assert code == 0, out
    assert f"would run: {bin_dir}/brew install espeak-ng sox\n" in out
    assert "apt" not in out and "Debian" not in out
    # uv is installed with the Mac's own Python, then the lock is synced with it
    assert f"would run: {bin_dir}/python3 -m venv .cache/uv" in out
    assert (
        f"would run: .cache/uv/bin/uv sync --frozen --quiet --compile-bytecode --python {bin_dir}/python3"
        in out
    )
    assert "LD_PRELOAD" not in out and "openblas.env" not in out


def test_mac_with_everything_present_installs_nothing(tmp_path):
    code, out, _ = _bootstrap(tmp_path, {"brew": FOUND, "python3": PYTHON_MAC, "espeak-ng": FOUND,
                                         "sox": FOUND})  # fmt: skip
    assert code == 0, out
    assert "brew" not in out and "WARNING" not in out
    assert "uv sync --frozen" in out


@pytest.mark.parametrize("probe", ['echo "False arm64"', 'echo "True x86_64"', "exit 1"],
                         ids=["python-3.9", "python-under-rosetta", "no-python"])  # fmt: skip
def test_mac_without_a_usable_python_gets_homebrews(tmp_path, probe):
    code, out, bin_dir = _bootstrap(tmp_path, {"brew": FOUND, "python3": probe, "espeak-ng": FOUND,
                                               "sox": FOUND})  # fmt: skip
    assert code == 0, out
    assert f"would run: {bin_dir}/brew install python@3.12\n" in out
    assert "uv sync --frozen --quiet --compile-bytecode --python python3.12" in out


def test_mac_without_homebrew_warns_with_the_commands_and_still_sets_up(tmp_path):
    code, out, _ = _bootstrap(tmp_path, {"python3": PYTHON_MAC})
    assert code == 0, out
    assert "WARNING: espeak-ng sox not installed and no Homebrew" in out
    assert HOMEBREW_URL in out and "then: brew install espeak-ng sox" in out
    assert "macOS's say" in out  # the demo still has speech
    assert "would run: brew" not in out and "uv sync --frozen" in out


def test_mac_without_homebrew_or_python_stops_with_the_one_command(tmp_path):
    code, out, _ = _bootstrap(tmp_path, {"python3": 'echo "False arm64"'})
    assert code == 1
    assert "ERROR: Python >= 3.11 for arm64 is needed and Homebrew is not installed" in out
    assert f'/bin/bash -c "$(curl -fsSL {HOMEBREW_URL})"' in out
    assert "uv sync" not in out


def test_an_intel_mac_or_a_rosetta_shell_is_refused(tmp_path):
    code, out, _ = _bootstrap(tmp_path, {"brew": FOUND, "python3": PYTHON_MAC}, arch="x86_64")
    assert code == 1
    assert "MLX needs Apple Silicon (arm64); this shell reports x86_64" in out
    assert "would run" not in out


def test_linux_keeps_the_debian_branch(tmp_path):
    code, out, _ = _bootstrap(tmp_path, {"dpkg-query": "exit 1", "python3": 'echo "True x86_64"'},
                              uname="Linux", arch="x86_64")  # fmt: skip
    assert code == 0, out
    assert "would install Debian packages: espeak-ng sox libportaudio2 libopenblas0-pthread" in out
    assert "LD_PRELOAD" not in out  # no file to source: fast_blas.py loads OpenBLAS in-process
    assert "brew" not in out


# -- the lock on macOS arm64 and x86_64 manylinux: uv's dry run against PyPI -------------------------

MACOS = "aarch64-apple-darwin"
MACOS_MIN = "14.0"  # mlx 0.32's wheels are macosx_14_0_arm64 and newer
LINUX = "x86_64-manylinux_2_36"  # Debian 12 (python:3.11-slim, the engine and agent images)
PYPI = "https://pypi.org/simple"


@pytest.fixture(scope="module")
def locked_requirements(tmp_path_factory) -> Path:
    """uv.lock as requirements (dev group included: the Mac runs the tests too), pinned, all
    platforms' markers kept; the workspace's own pure-Python members left out."""
    if not UV.is_file():
        pytest.fail(f"{UV} is missing: run scripts/bootstrap.sh (it installs the pinned uv)")
    for host in ("pypi.org", "files.pythonhosted.org"):
        try:
            socket.create_connection((host, 443), timeout=10).close()
        except OSError as e:
            pytest.fail(
                f"PyPI is unreachable ({host}: {e}): this check resolves the lock against it"
            )
    out = tmp_path_factory.mktemp("reqs") / "requirements.txt"
    subprocess.run([str(UV), "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--quiet",
                    "--format", "requirements-txt", "--output-file", str(out)],
                   cwd=REPO, check=True, timeout=60)  # fmt: skip
    return out


def _plan(requirements: Path, platform: str, python: str = "3.11", *,
          macos: str = MACOS_MIN) -> subprocess.CompletedProcess:  # fmt: skip
    """uv's install plan for `platform` from wheels only (a Mac user must not need a compiler):
    nothing is downloaded but metadata, nothing installed; cached under .cache/."""
    env = {**os.environ, "UV_CACHE_DIR": str(REPO / ".cache" / "uv-cross-platform"),
           "MACOSX_DEPLOYMENT_TARGET": macos, "UV_PYTHON_DOWNLOADS": "never"}  # fmt: skip
    cmd = [str(UV), "pip", "install", "--dry-run", "--no-config", "--default-index", PYPI,
           "--only-binary", ":all:", "--python", sys.executable, "--python-platform", platform,
           "--python-version", python, "--target", str(requirements.parent / "target"),
           "-r", str(requirements)]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _planned(r: subprocess.CompletedProcess) -> set[str]:
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    return {line.split()[1].split("==")[0] for line in out.splitlines() if line.startswith(" + ")}


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_every_locked_package_has_a_macos_arm64_wheel(locked_requirements, python):
    planned = _planned(_plan(locked_requirements, MACOS, python))
    assert {"mlx", "mlx-metal", "mlx-audio", "mlx-lm", "livekit", "onnxruntime",
            "ctranslate2", "av", "sounddevice"} <= planned  # fmt: skip
    assert "mlx-cpu" not in planned  # the Mac gets Metal, not the Linux CPU build
    assert len(planned) > 100


def test_every_locked_package_has_an_x86_64_manylinux_wheel(locked_requirements):
    planned = _planned(_plan(locked_requirements, LINUX))
    assert {"mlx", "mlx-cpu", "mlx-audio", "livekit"} <= planned and "mlx-metal" not in planned


def test_a_linux_only_pin_fails_the_mac_check(locked_requirements, tmp_path):
    # mlx-cpu ships manylinux wheels only and no sdist: the `mlx[cpu]` a Linux install needs,
    # added without its `sys_platform == 'linux'` marker.
    reqs = tmp_path / "requirements.txt"
    reqs.write_text(locked_requirements.read_text() + "mlx-cpu==0.32.4\n")
    r = _plan(reqs, MACOS)
    assert r.returncode != 0
    assert "mlx-cpu" in r.stderr and "no wheels with a matching platform tag" in r.stderr, r.stderr


def test_a_mac_only_pin_fails_the_linux_check(locked_requirements, tmp_path):
    reqs = tmp_path / "requirements.txt"
    reqs.write_text(locked_requirements.read_text() + "mlx-metal==0.32.4\n")
    r = _plan(reqs, LINUX)
    assert r.returncode != 0 and "mlx-metal" in r.stderr, r.stderr


def test_the_lock_needs_macos_14(locked_requirements):
    # av, mlx, mlx-metal and onnxruntime publish macOS arm64 wheels for 14 (Sonoma) and later only
    r = _plan(locked_requirements, MACOS, macos="13.0")
    assert r.returncode != 0 and "has no usable wheels" in r.stderr, r.stderr


# -- speech through macOS's `say`, with a stand-in -------------------------------------------------

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("sox") is None,
    reason="the stand-in say speaks with espeak-ng and sox (apt-get install espeak-ng sox)",
)
QUESTION = "Hello there. What time is it right now?"


def _stand_in_say(tmp_path: Path) -> tuple[Path, Path]:
    """A `say` that takes the real one's options (-o, --file-format, --data-format, -v, -r, -f),
    logs them and speaks with espeak-ng + sox at the rate asked; alone on PATH."""
    bin_dir, log = tmp_path / "say-bin", tmp_path / "say.log"
    bin_dir.mkdir()
    espeak, sox = shutil.which("espeak-ng"), shutil.which("sox")
    (bin_dir / "say").write_text(f"""#!{BASH}
set -eu
echo "$*" >> {log}
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out=$2; shift 2;;
    --file-format=WAVE) shift;;
    --data-format=LEI16@*) rate=${{1#*@}}; shift;;
    -v) voice=$2; shift 2;;
    -r) wpm=$2; shift 2;;
    -f) text=$2; shift 2;;
    *) echo "say: unexpected argument $1" >&2; exit 2;;
  esac
done
[ "$voice" = Samantha ] || {{ echo "Voice \\`$voice' not found." >&2; exit 1; }}
{espeak} -w "$out.raw.wav" ${{wpm:+-s $wpm}} -f "$text"
{sox} "$out.raw.wav" -b 16 -c 1 "$out" rate "$rate"
""")
    (bin_dir / "say").chmod(0o755)
    return bin_dir, log


@pytest.mark.parametrize(("requested", "platform", "installed", "tool"), [
    (None, "darwin", {"say"}, "say"),  # a Mac as it comes
    (None, "darwin", {"say", "espeak-ng"}, "espeak-ng"),  # Homebrew's espeak-ng: Linux's speech
    (None, "linux", set(), "espeak-ng"),  # its absence is reported when it runs
    ("say", "linux", {"espeak-ng"}, "say"),  # told
])  # fmt: skip
def test_the_speech_tool_choice(requested, platform, installed, tool):
    which = lambda name: f"/bin/{name}" if name in installed else None  # noqa: E731
    assert choose_speech_tool(requested, platform=platform, which=which) == tool


def test_an_unknown_speech_tool_is_refused(monkeypatch):
    monkeypatch.setenv("VOICE_AGENT_SPEECH_TOOL", "festival")
    with pytest.raises(ValueError, match="unknown speech tool 'festival'; one of espeak-ng, say"):
        choose_speech_tool()


@needs_espeak
def test_the_demo_question_through_say_is_real_speech_and_cached(
    tmp_path, monkeypatch, bundled_path
):
    from faster_whisper import WhisperModel

    from voice_agent.harness.demo import INPUT_RATE, load_turn_audio

    bin_dir, log = _stand_in_say(tmp_path)
    monkeypatch.setenv("PATH", str(bin_dir))  # say only: no espeak-ng, no sox, no afconvert
    monkeypatch.setenv("VOICE_AGENT_SPEECH_TOOL", "say")
    monkeypatch.setenv("VOICE_AGENT_CACHE", str(tmp_path / "cache"))

    samples = load_turn_audio(None)  # what `voice-agent demo` speaks without WAV arguments
    calls = log.read_text().splitlines()
    assert len(calls) == 1
    assert calls[0].startswith("-o ") and calls[0].split()[2:6] == [
        "--file-format=WAVE", f"--data-format=LEI16@{INPUT_RATE}", "-v", "Samantha"]  # fmt: skip
    cached = sorted((tmp_path / "cache" / "speech").iterdir())
    assert len(cached) == 1 and ".say-en-us.48000hz." in cached[0].name
    assert read_wav(cached[0])[1] == INPUT_RATE

    again = load_turn_audio(None)
    assert len(log.read_text().splitlines()) == 1  # the cache answered: say did not run again
    np.testing.assert_array_equal(again, samples)

    audio = samples[::3].astype(np.float32) / 32768  # 48 kHz -> 16 kHz (speech is band-limited)
    model = WhisperModel(str(bundled_path), device="cpu", compute_type="int8")
    segments, _ = model.transcribe(audio, language="en", beam_size=1)
    heard = " ".join(s.text for s in segments).lower()
    assert "what time is it" in heard, heard


@needs_espeak
def test_say_speed_and_voice_names_and_its_errors(tmp_path, monkeypatch):
    bin_dir, log = _stand_in_say(tmp_path)
    monkeypatch.setenv("PATH", str(bin_dir))
    normal = speech_wav(
        "Please book a table for four.", sample_rate=16000, cache_dir=tmp_path, tool="say"
    )
    fast = speech_wav("Please book a table for four.", sample_rate=16000, cache_dir=tmp_path,
                      tool="say", words_per_minute=260)  # fmt: skip
    assert fast != normal and "-r 260" in log.read_text()
    assert len(read_wav(fast)[0]) < 0.9 * len(read_wav(normal)[0])
    # an espeak-ng voice with no macOS twin goes to say as a name, and say's own error comes back
    with pytest.raises(RuntimeError, match="say failed .*Voice `de' not found"):
        speech_wav("Guten Tag.", sample_rate=16000, voice="de", cache_dir=tmp_path, tool="say")
    assert not list(tmp_path.glob("guten-tag*"))  # nothing half-written in the cache


def test_a_say_wav_that_wave_cannot_read_is_rewritten_as_plain_pcm(tmp_path, monkeypatch):
    """macOS's AudioToolbox may write WAVE_FORMAT_EXTENSIBLE headers (Python 3.11's `wave`
    refuses them) or another layout: the cache always holds mono 16-bit PCM at the rate asked."""
    bin_dir = tmp_path / "say-bin"
    bin_dir.mkdir()
    (bin_dir / "say").write_text(f"""#!{sys.executable}
import struct, sys
import numpy as np
out = sys.argv[sys.argv.index("-o") + 1]
rate, t = 22050, np.arange(22050) / 22050
tone = (0.5 * 32767 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
data = np.stack([tone, tone], axis=1).tobytes()  # stereo
fmt = struct.pack("<HHIIHHHHIH14s", 0xFFFE, 2, rate, rate * 4, 4, 16, 22, 16, 3, 1,
                  b"\\x00\\x00\\x00\\x00\\x10\\x00\\x80\\x00\\x00\\xaa\\x00\\x38\\x9b\\x71")
body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
open(out, "wb").write(b"RIFF" + struct.pack("<I", len(body)) + body)
""")
    (bin_dir / "say").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    path = speech_wav("A tone.", sample_rate=22050, cache_dir=tmp_path, tool="say")
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert len(samples) == 22050 and 0.45 * 32767 < np.abs(samples).max() < 0.55 * 32767


# -- `voice-agent console` start-up: progress of downloads and conversions, the cache ------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_newest_progress_takes_the_last_redrawn_bar():
    text = ("loading\nFetching 9 files:   0%|          | 0/9\rFetching 9 files:  44%|####4     | 4/9"
            "\rFetching 9 files:  56%|#####5    | 5/9\nINFO quantized talker\n")  # fmt: skip
    assert newest_progress(text) == "Fetching 9 files:  56%|#####5    | 5/9"
    assert newest_progress("no bars here\n") is None


def test_a_service_drawing_progress_is_waited_for_past_the_timeout(tmp_path, monkeypatch):
    """A first start downloads for minutes: its bars go to the terminal, and the timeout counts
    from the last one. Here the timeout is 2 s and the bars go on for longer: each next bar is
    drawn once the terminal showed the previous one (the wait looks every 0.25 s, so 12 bars take
    at least 2.75 s), and the service answers only after the last bar, so no gap depends on how
    fast this machine starts a process."""
    port, log = _free_port(), tmp_path / "service.log"
    log.write_text("an earlier start: Fetching 1 files: 100%|##########| 1/1\n")
    code = (f"import sys, http.server\n"
            f"sys.stdin.readline()\n"  # the downloads are done: it answers from now on
            f"http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler)"
            f".serve_forever()\n")  # fmt: skip
    offset = log.stat().st_size
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, cwd=tmp_path, text=True
    )
    terminal = _Terminal()
    bars = [f"Fetching 12 files: {100 * i // 12}%|{'#' * i}| {i}/12" for i in range(1, 13)]

    def service() -> None:  # its downloads, drawn into its log as tqdm draws them
        for bar in bars:
            with open(log, "a") as fh:
                fh.write(f"\r{bar}")
            deadline = time.monotonic() + 60
            while bar not in terminal.getvalue() and time.monotonic() < deadline:
                time.sleep(0.01)
        proc.stdin.write("go\n")
        proc.stdin.flush()

    monkeypatch.setattr(sys, "stderr", terminal)
    drawing = threading.Thread(target=service, daemon=True)
    try:
        t0 = time.monotonic()
        drawing.start()
        wait_until_ready(f"http://127.0.0.1:{port}/", proc, "the local TTS engine", 2.0, log,
                         port, offset)  # fmt: skip
        assert time.monotonic() - t0 > 2.0
    finally:
        drawing.join(65)
        proc.kill()
        proc.wait()
    shown = terminal.getvalue()
    assert all(f"\rvoice-agent: the local TTS engine: {bar}" in shown for bar in bars)
    assert "earlier start" not in shown and shown.endswith("\n")


def test_a_silent_service_still_times_out(tmp_path):
    log = tmp_path / "service.log"
    log.touch()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="did not answer .* within 1s without progress"):
            wait_until_ready(f"http://127.0.0.1:{_free_port()}/", proc, "the local LLM", 0.6,
                             log, 1)  # fmt: skip
    finally:
        proc.kill()
        proc.wait()


def test_the_llm_download_uses_the_hub_cache_first(tmp_path, monkeypatch):
    """A second start finds the LLM in the hub cache and asks nobody (the tests run offline, so
    any network use would fail); one that is not there fails in one line naming the setting."""
    from huggingface_hub import constants

    snapshot = tmp_path / "models--mlx-community--Qwen3-0.6B-4bit" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as tests/conftest.py sets it
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    download_llm("mlx-community/Qwen3-0.6B-4bit")
    assert terminal.getvalue() == ""  # cached: no download line
    with pytest.raises(
        RuntimeError, match="cannot download 'mlx-community/Qwen3-1.7B-4bit'.*LLM_MODEL"
    ):
        download_llm("mlx-community/Qwen3-1.7B-4bit")
    assert "downloading the LLM mlx-community/Qwen3-1.7B-4bit" in terminal.getvalue()
