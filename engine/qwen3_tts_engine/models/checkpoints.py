"""Where checkpoints live on disk and what identifies them: the quantize-on-load cache's
directory, keyed by the source's content digest and the recipe. Pure file work (no mlx): the
governor's quality gate and the worker's loader both use it."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from qwen3_tts_engine.models.recipes import Recipe


def cache_root() -> Path:
    return Path(os.environ.get("QWEN3_TTS_CACHE", "~/.cache/qwen3-tts")).expanduser()


def source_digest(path: Path) -> str:
    """sha256 over config.json and the root weight files (names and bytes).

    Cached per process while the files stay the same files (checkpoints are GBs): the key has
    the change time and inode besides the modification time, because copies that keep
    timestamps (`cp -p`, `rsync -t`) can put other weights behind the same mtime.
    """
    files = sorted([path / "config.json", *path.glob("*.safetensors")])
    stats = [f.stat() for f in files]
    return _digest(tuple(str(f.resolve()) for f in files),
                   tuple((s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_size) for s in stats))  # fmt: skip


@functools.lru_cache(maxsize=16)
def _digest(files: tuple[str, ...], stamps: tuple[tuple[int, ...], ...]) -> str:
    h = hashlib.sha256()
    for f in map(Path, files):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def recipe_digest(recipe: Recipe) -> str:
    return hashlib.sha256(repr(recipe).encode()).hexdigest()[:12]


def quantized_cache_dir(src: Path, recipe: Recipe) -> Path:
    return (
        cache_root()
        / "quantized"
        / f"{source_digest(src)[:16]}-{recipe.name}-{recipe_digest(recipe)}"
    )
