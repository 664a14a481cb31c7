"""infra/haproxy/haproxy.cfg: valid for HAProxy, and it balances real engines by streams in flight.

The shipped file is checked with `haproxy -c`; then its backend runs on loopback in front of two
real engine servers (tiny checkpoint): only the listening address and the server list change
(its DNS-filled servers become the two engines' addresses), the balancing, health check and
limits are the file's own. Two held streams land one on each engine; when the second ends, a third
goes to the engine it left idle (leastconn: round robin would give the first engine its turn), as
each engine's GET /load shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from tests.support.engine_process import free_port

CONFIG = Path(__file__).resolve().parents[2] / "infra" / "haproxy" / "haproxy.cfg"
HANG_GUARD_S = 120.0


@pytest.fixture(scope="module")
def haproxy() -> str:
    path = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy",) if Path(p).is_file()), None
    )
    if path is None:
        pytest.skip(
            "haproxy is not installed (Debian package haproxy; scripts/bootstrap.sh installs it)"
        )
    return path


def test_the_shipped_config_is_valid(haproxy):
    out = subprocess.run(
        [haproxy, "-c", "-f", str(CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = CONFIG.read_text()
    assert re.search(r"^\s*balance leastconn$", text, re.M)
    assert re.search(r"^\s*option httpchk GET /ready$", text, re.M)
    assert "server-template engine" in text and "tts-engine:8880" in text  # the compose service


def loopback_config(ports: list[int], listen: int, stats: Path) -> str:
    """The shipped file with its address and server list for loopback engines."""
    text = CONFIG.read_text()
    text = re.sub(r"^(\s*)bind :8880$", rf"\1bind 127.0.0.1:{listen}", text, flags=re.M)
    servers = "\n".join(f"    server engine{i} 127.0.0.1:{p} check" for i, p in enumerate(ports, 1))
    text, n = re.subn(r"^\s*server-template .*$", servers, text, flags=re.M)
    assert n == 1
    return text.replace("global\n", f"global\n    stats socket {stats} level admin\n", 1)


def servers_up(stats: Path) -> int:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(stats))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    rows = [
        line.split(",") for line in data.decode().splitlines() if line.startswith("engines,engine")
    ]
    return sum(row[17] == "UP" for row in rows)  # column 17: status


@pytest.fixture(scope="module")
async def engines(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice", eos="never"))
    servers = [EngineServer(Engine(model, [Handler(model, max_batch=2, frame_budget_s=None)]),
                            ServerConfig(port=0)) for _ in range(2)]  # fmt: skip
    for srv in servers:
        await srv.start()
    yield servers
    for srv in servers:
        await srv.stop()


async def test_haproxy_sends_a_stream_to_the_engine_with_fewest_streams(haproxy, engines, tmp_path):
    """Least connections, not turns: two held streams land one on each engine; the second one
    ends; the third goes to the engine that is now idle. Round robin would send it to the first
    engine again (its turn), so this fails if haproxy.cfg said `balance roundrobin`."""
    listen, stats = free_port(), tmp_path / "stats.sock"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(loopback_config([e.port for e in engines], listen, stats))
    proc = await asyncio.create_subprocess_exec(haproxy, "-f", str(cfg), "-db",
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        async with asyncio.timeout(HANG_GUARD_S):  # both engines pass the file's /ready check
            while proc.returncode is None and not (stats.exists() and servers_up(stats) == 2):
                await asyncio.sleep(0.1)
        assert proc.returncode is None, (await proc.stderr.read()).decode()
        body = {"input": "Hold this line.", "voice": "ryan", "stream": True, "response_format": "pcm",
                "max_new_tokens": 400, "seed": 1}  # fmt: skip
        async with httpx.AsyncClient(timeout=600) as client:

            async def running() -> list[int]:
                return [(await client.get(f"http://127.0.0.1:{e.port}/load")).json()["running"]
                        for e in engines]  # fmt: skip

            async def hold(stack: contextlib.AsyncExitStack) -> None:
                """A stream through HAProxy that has had its first audio and is then not read."""
                r = await stack.enter_async_context(
                    client.stream("POST", f"http://127.0.0.1:{listen}/v1/audio/speech", json=body)
                )
                assert r.status_code == 200
                chunks = r.aiter_raw()
                await anext(chunks)
                held.append(chunks)  # kept: a collected iterator would close the response

            held: list = []
            async with contextlib.AsyncExitStack() as first:
                await hold(first)
                (a,) = [i for i, n in enumerate(await running()) if n == 1]
                async with contextlib.AsyncExitStack() as second:
                    await hold(second)
                    assert await running() == [1, 1]  # one on each: the other had none
                # the second stream has ended: its engine is idle once it has let go of it
                b = 1 - a
                async with asyncio.timeout(HANG_GUARD_S):
                    while (now := await running())[b] != 0:
                        await asyncio.sleep(0.05)
                assert now[a] == 1
                async with contextlib.AsyncExitStack() as third:
                    await hold(third)
                    assert await running() == [1, 1], (
                        "the third stream did not go to the idle engine"
                    )
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
