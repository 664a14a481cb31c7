"""The `livekit_server` fixture: a real LiveKit server for the tests (the pinned `livekit-server`
binary on 127.0.0.1, started by `voice_agent.harness.livekit_server`, which the soak shares).

Without the binary the tests that need a server are skipped. When `LIVEKIT_URL` is set, that
server is used instead (with `LIVEKIT_API_KEY` / `LIVEKIT_API_SECRET`, default devkey / secret)
and nothing is started.
"""

from __future__ import annotations

import os

import pytest

from voice_agent.harness.livekit_server import (
    INSTALL_HINT,
    VERSION,
    LiveKitServer,
    binary_path,
    find_binary,
    start_server,
    stop_server,
)


@pytest.fixture(scope="session")
def livekit_server(tmp_path_factory):
    """A LiveKitServer: the external one of LIVEKIT_URL, or a local livekit-server on free ports."""
    if os.environ.get("LIVEKIT_URL"):
        yield LiveKitServer(os.environ["LIVEKIT_URL"], os.environ.get("LIVEKIT_API_KEY", "devkey"),
                            os.environ.get("LIVEKIT_API_SECRET", "secret"))  # fmt: skip
        return
    binary = find_binary()
    if binary is None:
        problem = f"no livekit-server {VERSION} binary at {binary_path()}: {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI is set and the LiveKit tests cannot run: {problem}")
        pytest.skip(problem)
    server = start_server(binary, tmp_path_factory.mktemp("livekit-server"))
    try:
        yield server
    finally:
        stop_server(server)
