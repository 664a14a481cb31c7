"""What a starting service is doing, for a person watching a terminal: progress lines, the
progress bars it writes to its log (hub downloads, quantize-on-load), and waiting until it answers.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from voice_agent.services.probes import answers, holder

# a tqdm bar ("Fetching 9 files:  44%|####4     | 4/9 [00:12<00:15, ...]"): a download or conversion
_PROGRESS_BAR = re.compile(r"\d+%\|")


def progress(message: str) -> None:
    """A progress line for a person watching a terminal (start-up takes seconds to minutes);
    nothing when stderr is not a terminal, so logs and captured output hold only results."""
    if sys.stderr.isatty():
        print(f"voice-agent: {message}", file=sys.stderr, flush=True)


def newest_progress(text: str) -> str | None:
    """The newest progress-bar line in `text` (tqdm redraws a bar after a carriage return)."""
    bars = [part.strip() for part in re.split(r"[\r\n]", text) if _PROGRESS_BAR.search(part)]
    return bars[-1] if bars else None


class _LogProgress:
    """The progress bars a starting service writes to its log (hub downloads, quantize-on-load),
    relayed to a person watching the terminal on one line that redraws."""

    def __init__(self, log: Path, offset: int) -> None:
        self.log, self.offset, self.last, self.shown = log, offset, None, False

    def poll(self, what: str) -> bool:
        """True when the service drew a new bar since the last look (it is making progress)."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return False
        self.offset += len(data)
        bar = newest_progress(data.decode(errors="replace"))
        if bar is None or bar == self.last:
            return False
        self.last = bar
        if sys.stderr.isatty():
            print(f"\rvoice-agent: {what}: {bar[:150]}\x1b[K", end="", file=sys.stderr, flush=True)
            self.shown = True
        return True

    def end(self) -> None:
        if self.shown:
            print(file=sys.stderr, flush=True)
            self.shown = False


def wait_until_ready(url: str, proc: subprocess.Popen, what: str, timeout: float, log: Path,
                     port: int, log_offset: int = 0) -> None:  # fmt: skip
    """Until `url` answers. `timeout` counts from the service's last progress bar, so a first
    start that downloads gigabytes on a slow link is not cut short while the bytes keep coming."""
    relay = _LogProgress(log, log_offset)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if relay.poll(what):
                deadline = time.monotonic() + timeout
            if answers(url):
                return
            if proc.poll() is not None:
                # one line: the last line of its log (an exception, usually) and where the rest is
                lines = (
                    log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
                )
                last = f": {lines[-1].strip()}" if lines else ""
                who = holder(port)
                held = f"; port {port} is in use by {who}" if who else ""
                code = proc.returncode
                raise RuntimeError(f"{what} exited with code {code}{last} (log: {log}){held}")
            time.sleep(0.25)
    finally:
        relay.end()
    raise TimeoutError(f"{what} did not answer {url} within {timeout:.0f}s without progress "
                       f"(log: {log})")  # fmt: skip
