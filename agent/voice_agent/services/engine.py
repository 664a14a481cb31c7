"""The TTS engine the agent uses: the configured URL, a running local engine of ours, or a new
one (offline without the model: the generated tiny checkpoint, whose voice is noise)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from voice_agent.services.offline import RANDOM_TTS, hub_model_available
from voice_agent.services.probes import existing, probe_tts
from voice_agent.services.progress import progress
from voice_agent.services.registry import HostLock, LocalService, join, sigterm_as_interrupt
from voice_agent.services.start import start_service
from voice_agent.settings import Settings

logger = logging.getLogger("voice_agent")


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else name


def ensure_tts_engine(settings: Settings, *, timeout: float = 900.0) -> LocalService:
    """The TTS URL to use: the configured one, a running local engine of ours, or a new one."""
    if settings.tts_url:
        return LocalService("tts", settings.tts_url)
    port = settings.tts_port
    url, key = f"http://127.0.0.1:{port}", f"tts-{port}"
    with sigterm_as_interrupt(), HostLock(key):
        if existing(key, port, lambda: probe_tts(url), "a Qwen3-TTS engine of ours",
                    "TTS_PORT or --tts-port"):  # fmt: skip
            logger.info("reusing the TTS engine already running at %s", url)
            progress(f"using the TTS engine already running on port {port}")
            join(key)
            return LocalService("tts", url, host_key=key)
        model, notes = settings.tts_model, ()
        variant = settings.tts_variant
        if not hub_model_available(model, settings.offline):
            # optional extra: the engine package (`voice-agent[local]`); a TTS_URL needs none
            from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

            model, variant, notes = str(default_tiny_checkpoint()), None, (RANDOM_TTS,)
        cmd = [_bin("qwen3-tts"), "serve", "--model", model, "--port", str(port)]
        if variant:
            cmd += ["--variant", variant]
        proc = start_service(key, cmd, f"tts-engine-{port}.log", f"{url}/ready", "the local TTS engine",
                             timeout, port)  # fmt: skip
        return LocalService("tts", url, proc, notes, host_key=key)
