"""A tiny random mlx-lm chat model (Qwen3 architecture) for running the local-LLM path offline.

Its answers are random, but `mlx_lm.server` loads and serves it through the same OpenAI-compatible
code path as a real instruct model.
"""

from __future__ import annotations

import json
from pathlib import Path

# Qwen's ChatML template, reduced to what an agent sends (system/user/assistant/tool turns).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] if message['content'] is string else '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _compact_tokenizer(out: Path) -> tuple[int, int]:
    """Drop the TTS tokenizer's filler entries (kept there only to reach Qwen's real special-token
    ids) and renumber the added tokens after the trained BPE vocabulary: a small output head whose
    every token is a real piece of text. Returns (vocab_size, id of <|im_end|>)."""
    vocab = json.loads((out / "vocab.json").read_text())
    real = {t: i for t, i in vocab.items() if not t.startswith("<|tiny_unused_")}
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    added = sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    cfg["added_tokens_decoder"] = {str(len(real) + k): tok for k, (_, tok) in enumerate(added)}
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "vocab.json").write_text(json.dumps(real, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    im_end = next(
        int(i) for i, t in cfg["added_tokens_decoder"].items() if t["content"] == "<|im_end|>"
    )
    return len(real) + len(added), im_end


def write_tiny_llm(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny random model (config, weights, tokenizer) into `out_dir`."""
    # optional extras (`voice-agent[local]`): mlx-lm, and the engine's tiny tokenizer
    from qwen3_tts_engine.open_files import import_mlx_lm

    import_mlx_lm()  # keeps this process's open-file limit (mlx-lm would lower it)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    from qwen3_tts_engine.tiny_checkpoints.builder import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    vocab_size, im_end = _compact_tokenizer(out)
    config = {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "eos_token_id": im_end,
    }  # fmt: skip
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
