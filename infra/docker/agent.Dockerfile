# Images for infra/compose.yaml and infra/k8s/, built from the repository root:
#   docker build -f infra/docker/agent.Dockerfile --target agent      -t qwen3-voice-agent .
#   docker build -f infra/docker/agent.Dockerfile --target tts-engine -t qwen3-tts-engine .
# Both install exactly uv.lock (`uv sync --frozen`), with the uv version scripts/bootstrap.sh pins.
# tests/infra/test_infra.py checks that every file copied here exists and that the package names are
# workspace members, and plans the engine image's install from only what its stage copies (no
# docker engine runs in the tests).
#
# Both images run as the unprivileged user `app` (uid/gid 10001): the code and the virtual
# environment belong to root and are read-only to it; its only writable paths are its caches
# (/home/app/.cache: Hugging Face downloads, quantize-on-load results, the agent's files) and /tmp.
# compose.yaml and the Kubernetes files mount volumes there and keep the rest read-only.

FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv \
    PATH=/app/.venv/bin:$PATH
RUN pip install --no-cache-dir uv==0.13.9
RUN groupadd --gid 10001 app \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/app --shell /usr/sbin/nologin app \
    && mkdir -p /home/app/.cache/huggingface /home/app/.cache/qwen3-tts /home/app/.cache/qwen3-voice-agent \
    && chown -R app:app /home/app/.cache
WORKDIR /app
# The workspace: root project, lock file and every member's manifest (uv reads the workspace
# from them); each image then copies the sources of the members it installs.
COPY pyproject.toml uv.lock ./
COPY agent/pyproject.toml agent/
COPY engine/pyproject.toml engine/
COPY plugins/livekit-plugins-qwen3-tts/pyproject.toml plugins/livekit-plugins-qwen3-tts/
COPY plugins/livekit-plugins-faster-whisper/pyproject.toml plugins/livekit-plugins-faster-whisper/

# -- the LiveKit agent worker ------------------------------------------------------------------
# Only voice-agent and its dependencies (no `local` extra: no mlx, no mlx-lm); the TTS engine and
# the LLM are other services (TTS_URL, LLM_BASE_URL). libportaudio2 is not installed: it is only
# needed by `voice-agent console` (a local microphone), never in a container.
FROM base AS agent
COPY agent/ agent/
COPY plugins/livekit-plugins-qwen3-tts/ plugins/livekit-plugins-qwen3-tts/
COPY plugins/livekit-plugins-faster-whisper/ plugins/livekit-plugins-faster-whisper/
RUN uv sync --frozen --no-dev --package voice-agent
# LiveKit's health endpoint (GET / on 8081 in `start` mode); METRICS_PORT for Prometheus if set.
EXPOSE 8081
# Exec form: the worker is PID 1 and gets SIGTERM itself; the first SIGTERM drains (no new jobs,
# calls in progress finish), a second one exits at once. See infra/k8s/agent-worker.yaml.
STOPSIGNAL SIGTERM
ENV HOME=/home/app
USER 10001:10001
CMD ["voice-agent", "start"]

# -- the Qwen3-TTS engine server ---------------------------------------------------------------
# mlx's Linux CPU backend: functional, far from real time (docs/benchmarks.md); Apple
# Silicon hosts run `qwen3-tts serve` natively, GPU hosts run vLLM-Omni (TTS_PROTOCOL=vllm-omni).
FROM base AS tts-engine
# mlx-cpu links the reference BLAS; OpenBLAS preloaded is several times faster (docs/benchmarks.md: BLAS).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "$(ls /usr/lib/*/libopenblas.so.0 /usr/lib/*/openblas-pthread/libopenblas.so.0 2>/dev/null | head -1)" \
       /usr/local/lib/libopenblas-preload.so.0
ENV LD_PRELOAD=/usr/local/lib/libopenblas-preload.so.0
# The engine package alone: no LiveKit, no agent (tests/engine/test_package.py plans this install).
COPY engine/ engine/
RUN uv sync --frozen --no-dev --package qwen3-tts-engine
EXPOSE 8880
STOPSIGNAL SIGTERM
ENV HOME=/home/app
USER 10001:10001
# Listening on every interface needs QWEN3_TTS_API_KEY (the engine refuses to start without it).
CMD ["qwen3-tts", "serve", "--host", "0.0.0.0", "--port", "8880"]
