"""Names the engine accepts, as literal types (editors complete them; any string still passes).

Voices are the 0.6B/1.7B CustomVoice models' preset speakers; OpenAI's voice names are aliases
the engine maps onto them (`qwen3-tts serve --voice-alias`). Variants are the engine's built-in
quantizations (`qwen3-tts variant`); a recipe file's name works too.
"""

from __future__ import annotations

from typing import Literal

TTSModels = Literal[
    "qwen3-tts",
    "mlx-community/Qwen3-TTS-12Hz-0.6B-CustomVoice",
    "mlx-community/Qwen3-TTS-12Hz-0.6B-Base",
    "mlx-community/Qwen3-TTS-12Hz-1.7B-CustomVoice",
    "mlx-community/Qwen3-TTS-12Hz-1.7B-VoiceDesign",
    "mlx-community/Qwen3-TTS-12Hz-1.7B-Base",
]
TTSVoices = Literal[
    "vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee",
    # OpenAI's names, mapped by the engine onto the voices above
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
    "verse", "marin", "cedar",
]  # fmt: skip
TTSLanguages = Literal[
    "auto", "chinese", "english", "japanese", "korean", "german", "french", "russian",
    "portuguese", "spanish", "italian",
]  # fmt: skip
TaskTypes = Literal["custom_voice", "voice_design", "base"]
Variants = Literal[
    "bf16", "8bit", "6bit", "4bit", "talker-mlp-w4", "keep-code-predictor", "4bit-emb8",
    "4bit-emb4", "4bit-temb4-cemb8-voc16", "4bit-emb4-voc16",
]  # fmt: skip
Protocol = Literal["qwen3-tts", "vllm-omni"]
FirstChunkFrames = Literal[1, 2, 4]
Strategy = Literal["balanced", "priority"]  # how the plugin picks among its engines
# How a stream's text reaches the engine: "stream" sends it as it comes over the engine's
# streaming-text WebSocket (one socket per reply segment), "sentences" as one HTTP request per
# sentence (and first clause), "auto" streams where the engine's status says `streaming_text`.
TextInput = Literal["auto", "stream", "sentences"]
