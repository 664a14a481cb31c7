"""A delay line to a network namespace: every IP packet between this host and the namespace, the
TCP handshake's included, arrives RTT/2 late each way, as `tc qdisc ... netem delay` would make
it where the kernel has no netem. For the link bench (`link_bench.py`); needs root.

Two TUN devices: one here (address `near`), one moved into the namespace (address `far`); a
forwarder process reads each packet from one device and writes it to the other RTT/2 later, in
order. `python -m voice_agent.lab.delay_line NETNS RTT_MS INDEX` is that forwarder: it sets the
devices up, prints `ready`, forwards until SIGTERM (or its stdin closes: its parent is gone), then
prints its packet counts as JSON.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
from collections.abc import Sequence

TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
READY_TIMEOUT_S = 30.0


def addresses(index: int) -> tuple[str, str]:
    """(near, far) of delay line `index` (0..249): a /30 of their own, so lines can coexist."""
    if not 0 <= index < 250:
        raise ValueError(f"a delay line index is 0..249, not {index}")
    return f"10.77.{index}.1", f"10.77.{index}.2"


class DelayLine:
    """`with DelayLine(rtt_ms) as line:` the namespace `line.netns`, where `line.far` is this
    host's address, reached from here (`line.near`) through the forwarder; `line.argv(cmd)` runs
    `cmd` in the namespace. `line.packets` (after the block): packets forwarded each way."""

    def __init__(self, rtt_ms: float, index: int | None = None) -> None:
        if not rtt_ms >= 0:
            raise ValueError(f"rtt_ms must be >= 0, not {rtt_ms!r}")
        if os.geteuid() != 0:
            raise PermissionError("the delay line needs root (network namespaces, TUN devices)")
        self.rtt_ms = rtt_ms
        self.index = os.getpid() % 250 if index is None else index
        self.near, self.far = addresses(self.index)
        self.netns = f"qtts-delay-{self.index}"
        self.packets: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None

    def argv(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]

    def __enter__(self) -> DelayLine:
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)  # a stale one
        subprocess.run(["ip", "netns", "add", self.netns], check=True, capture_output=True)
        try:
            subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True,
                           capture_output=True)  # fmt: skip
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "voice_agent.lab.delay_line", self.netns, str(self.rtt_ms),
                 str(self.index)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            line = _read_line(self._proc, READY_TIMEOUT_S)
            if line != "ready":
                raise RuntimeError(f"the delay line's forwarder did not start: {line!r}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=10)
                self.packets = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
            except (subprocess.TimeoutExpired, ValueError):
                proc.kill()
                proc.wait()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The process's next stdout line within `timeout` ("" if it ended first)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return f"nothing within {timeout:g} s"
    return proc.stdout.readline().strip()


# -- the forwarder (its own process) ---------------------------------------------------------


def _tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


class _Direction:
    """Packets read from one device, written to the other `delay` seconds later, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src: int, dst: int, delay: float) -> None:
        self.loop, self.src, self.dst, self.delay = loop, src, dst, delay
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.count = 0
        self.timer: asyncio.TimerHandle | None = None
        loop.add_reader(src, self.read)

    def read(self) -> None:
        while True:
            try:
                packet = os.read(self.src, 65536)
            except BlockingIOError:
                break
            self.queue.append((self.loop.time() + self.delay, packet))
        if self.timer is None and self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self.write)

    def write(self) -> None:
        self.timer = None
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, packet = self.queue.popleft()
            try:
                os.write(self.dst, packet)
                self.count += 1
            except OSError:  # the device is full or going: a lost packet (TCP resends it)
                pass
        if self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self.write)


def _devices(netns: str, index: int) -> tuple[int, int]:
    """The two TUN devices, set up: (the one here, the one in `netns`)."""
    near, far = addresses(index)
    here, there = f"qd{index}n", f"qd{index}f"
    near_fd, far_fd = _tun(here), _tun(there)
    for cmd in (["ip", "link", "set", there, "netns", netns],  # the fd stays the device's
                ["ip", "addr", "add", near, "peer", far, "dev", here],
                ["ip", "link", "set", here, "up"],
                ["ip", "-n", netns, "addr", "add", far, "peer", near, "dev", there],
                ["ip", "-n", netns, "link", "set", there, "up"]):  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
    return near_fd, far_fd


async def _forward(near_fd: int, far_fd: int, rtt_ms: float) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    delay = rtt_ms / 2000.0
    out = _Direction(loop, near_fd, far_fd, delay)
    back = _Direction(loop, far_fd, near_fd, delay)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if not sys.stdin.isatty():
        loop.add_reader(sys.stdin.fileno(), lambda: os.read(sys.stdin.fileno(), 1024) or stop.set())
    print("ready", flush=True)
    await stop.wait()
    return {"near_to_far": out.count, "far_to_near": back.count}


def main(argv: list[str] | None = None) -> int:
    netns, rtt_ms, index = argv or sys.argv[1:]
    near_fd, far_fd = _devices(netns, int(index))
    print(json.dumps(asyncio.run(_forward(near_fd, far_fd, float(rtt_ms)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
