"""The LLM the agent uses: the configured OpenAI-compatible URL, or a local mlx_lm.server of ours
(a hub model downloaded first, in the foreground; offline without it: a generated tiny model)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from voice_agent.services.offline import RANDOM_LLM, hub_model_available
from voice_agent.services.probes import existing, probe_llm
from voice_agent.services.progress import progress
from voice_agent.services.registry import (
    HostLock,
    LocalService,
    cache_dir,
    join,
    sigterm_as_interrupt,
)
from voice_agent.services.start import start_service
from voice_agent.services.tiny_llm import write_tiny_llm
from voice_agent.settings import Settings

logger = logging.getLogger("voice_agent")

# what mlx_lm.server downloads for a hub model (mlx-lm 0.32's `DEFAULT_ALLOW_PATTERNS`)
MLX_LM_FILES = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]  # fmt: skip


def _hub_cache_exists() -> None:
    """mlx_lm.server lists the hub cache for `/v1/models` and, when it does not exist, answers 200
    with an empty body: make it exist (a download would create it too)."""
    try:
        # only a local LLM needs the hub client (CLI start-up time); imported late, it also reads
        # the HF_* environment as this process has set it by now (HF_HUB_OFFLINE, resolve_offline)
        from huggingface_hub import constants

        Path(constants.HF_HUB_CACHE).mkdir(parents=True, exist_ok=True)
    except (ImportError, OSError):
        pass


def download_llm(model: str) -> None:
    """Fetch a hub LLM into the hub cache here, in the foreground with its progress bars, before
    mlx_lm.server starts: the server answers at once and loads (downloads) the model behind that
    answer, where nobody sees it and the first reply waits. A model already in the cache is used
    without asking the hub."""
    # only a local LLM needs the hub client (CLI start-up time: ~0.5 s to import)
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(model, allow_patterns=MLX_LM_FILES, local_files_only=True)
        return
    except Exception:  # not (completely) in the cache: huggingface_hub raises several types
        pass
    progress(f"downloading the LLM {model} into the hub cache (once) ...")
    try:
        snapshot_download(model, allow_patterns=MLX_LM_FILES)
    except Exception as e:
        raise RuntimeError(f"cannot download {model!r} ({type(e).__name__}: {e}); without a "
                           "network, pass a local model directory (LLM_MODEL)") from e  # fmt: skip


def ensure_llm(settings: Settings, *, timeout: float = 600.0) -> LocalService:
    """The LLM base URL to use: the configured one, or a local mlx_lm.server of ours."""
    if settings.llm_base_url:
        return LocalService("llm", settings.llm_base_url)
    port = settings.llm_port
    url, key = f"http://127.0.0.1:{port}", f"llm-{port}"
    with sigterm_as_interrupt(), HostLock(key):
        found = existing(key, port, lambda: probe_llm(url), "an mlx_lm.server of ours",
                         "LLM_PORT or --llm-port")  # fmt: skip
        if found:
            probe, started = found
            logger.info("reusing the LLM server already running at %s", url)
            progress(f"using the LLM server already running on port {port}")
            # mlx_lm.server loads the model a request names: the one it was started with
            model = (started.model if started and started.model
                     else settings.llm_model if settings.llm_model in probe.models
                     else probe.models[-1] if probe.models else None)  # fmt: skip
            join(key)
            return LocalService("llm", f"{url}/v1", model=model, host_key=key)
        model, notes = settings.llm_model, ()
        if not hub_model_available(model, settings.offline):
            path = cache_dir() / "tiny-llm"
            if not (path / "config.json").is_file():
                write_tiny_llm(path)
            model, notes = str(path), (RANDOM_LLM,)
        elif not Path(model).expanduser().is_dir():
            download_llm(model)
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
        # the engine comes with mlx-lm in the [local] extra: an optional import, as mlx-lm's
        from qwen3_tts_engine.fast_blas import environment_for_child

        # mlx on a Linux CPU: Debian's OpenBLAS preloaded for the server's matmuls (fast_blas.py)
        env = environment_for_child(
            {**os.environ, **({"HF_HUB_OFFLINE": "1"} if settings.offline else {})}
        )
        _hub_cache_exists()
        proc = start_service(key, cmd, f"mlx-lm-server-{port}.log", f"{url}/v1/models",
                             "the local LLM (mlx_lm.server)", timeout, port, env, model)  # fmt: skip
        # mlx_lm.server loads the model a request names: name the one it was started with.
        return LocalService("llm", f"{url}/v1", proc, notes, model=model, host_key=key)
