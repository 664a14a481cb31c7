"""The quantization toolkit: eval, ablate, GPTQ and reports (`qwen3-tts eval|ablate|quantize`).

Charts need the extra: pip install 'qwen3-tts-engine[quant]'."""
