"""What a loaded model and its worker process take: parameter bytes by part, the KV cache a
stream adds per frame, and the process's memory (the governor's footprints are built from these,
`models/footprint.py`)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten

from qwen3_tts_engine.models.stream_memory import StreamLayout


def process_memory() -> dict:
    """This process's RSS and mlx's own memory counters."""
    return {
        "rss_bytes": psutil.Process().memory_info().rss,
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_cache_bytes": mx.get_cache_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
    }


def model_bytes(model) -> dict[str, int]:
    """Bytes of a loaded model's parameters by part: the talker (what recipes quantize), the
    speech tokenizer (vocoder, plus its encoder where kept) and the speaker encoder."""
    parts = {"talker_bytes": 0, "speech_tokenizer_bytes": 0, "speaker_encoder_bytes": 0}
    for key, value in tree_flatten(model.parameters()):
        part = key.split(".", 1)[0]
        parts[f"{part}_bytes" if f"{part}_bytes" in parts else "talker_bytes"] += value.nbytes
    return parts


def kv_bytes_per_frame(model) -> int:
    """KV-cache bytes one active stream adds per 80 ms frame: the talker's cache (one position
    per frame, in the weights' dtype) plus the vocoder's decoder transformer (one position per
    frame; a plain growing cache in mlx-audio 0.6, NOTES). The code predictor's cache is rebuilt
    every frame and stays a few positions long."""
    t = model.config.talker_config
    dtype = model.talker.model.norm.weight.dtype
    talker = t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * dtype.size
    vocoder = 0
    st = getattr(model, "speech_tokenizer", None)
    if st is not None:
        d = st.config.decoder_config
        head_dim = getattr(d, "head_dim", d.hidden_size // d.num_attention_heads)
        size = next(
            (v.dtype.size for k, v in tree_flatten(st.parameters()) if "pre_transformer" in k), 4
        )
        vocoder = d.num_hidden_layers * 2 * d.num_key_value_heads * head_dim * size
    return talker + vocoder


def stream_layout(model) -> StreamLayout:
    """What one stream of this loaded model holds (`models/stream_memory.py`), from its config
    and the dtypes it runs in: the talker's (and code predictor's) as loaded, which a compute
    dtype widens, and the vocoder's pre-transformer's."""
    dtype = model.talker.model.norm.weight.dtype
    st = getattr(model, "speech_tokenizer", None)
    decoder, size = None, 4
    if st is not None:
        decoder = dataclasses.asdict(st.config.decoder_config)
        size = next(
            (v.dtype.size for k, v in tree_flatten(st.parameters()) if "pre_transformer" in k), 4
        )
    return StreamLayout.from_config(dataclasses.asdict(model.config.talker_config), dtype.size,
                                    decoder, size)  # fmt: skip
