"""Memory probes: how much memory the engine may still use, from the tightest source that applies.

One interface (`MemoryProbe.read() -> MemoryReading`), several sources chosen automatically: a
cgroup v2 or v1 limit (containers, Kubernetes), else the system's available memory (psutil),
plus the kernel's pressure level on macOS. File parsing is pure so it is tested on fake files.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

# cgroup v1 writes "no limit" as LONG_MAX rounded down to a page; anything this large is none.
_UNLIMITED = 1 << 60
SOURCES = ("auto", "cgroup-v2", "cgroup-v1", "system", "macos")


@dataclass(frozen=True)
class MemoryReading:
    """One look at memory: `used_bytes` of `limit_bytes` (working set: page cache excluded)."""

    source: str  # cgroup-v2 | cgroup-v1 | system | macos | manual
    limit_bytes: int
    used_bytes: int
    kernel_level: str | None = None  # macOS only: normal | warn | critical
    at: float = field(default_factory=time.monotonic)
    detail: str = ""  # which cgroup (or other origin) the numbers come from

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)

    @property
    def pressure(self) -> float:
        """Used fraction of the limit, 0..1 (can exceed 1 briefly under a cgroup limit)."""
        return self.used_bytes / self.limit_bytes if self.limit_bytes > 0 else 1.0

    def as_dict(self) -> dict:
        return {"source": self.source, "pressure": round(self.pressure, 4),
                "limit_bytes": self.limit_bytes, "used_bytes": self.used_bytes,
                "available_bytes": self.available_bytes, "kernel_level": self.kernel_level,
                "detail": self.detail}  # fmt: skip


class MemoryProbe(Protocol):
    source: str

    def read(self) -> MemoryReading: ...


# -- pure parsing ---------------------------------------------------------------------------


def parse_limit(text: str) -> int | None:
    """A limit file's value in bytes; None for "max" (v2) or the v1 "unlimited" sentinel."""
    text = text.strip()
    if text == "max" or not text:
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def parse_memory_stat(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def working_set(usage: int, stat: dict[str, int]) -> int:
    """Usage minus inactive file cache, as the kubelet counts it: the kernel reclaims that cache
    before it OOM-kills anything, so it is not pressure."""
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return max(0, usage - inactive)


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/self/cgroup -> {"memory": v1 path, "": v2 path} (other v1 controllers too)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            out[controller] = parts[2]
    return out


@dataclass(frozen=True)
class Mount:
    root: str  # the cgroup path that this mount point shows
    mount_point: str
    fstype: str
    super_options: tuple[str, ...]


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        mounts.append(Mount(lf[3], lf[4].replace("\\040", " "), rf[0], tuple(rf[2].split(","))))
    return mounts


def _under_mount(mount: Mount, cgroup_path: str) -> Path:
    # Without a cgroup namespace the mount shows some ancestor (mount.root) of our path.
    root = mount.root.rstrip("/")
    rel = cgroup_path[len(root) :] if cgroup_path.startswith(root) else ""
    return Path(mount.mount_point) / rel.lstrip("/")


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> dict[str, tuple[Path, Path]]:
    """{"cgroup-v2" | "cgroup-v1": (this process's directory, the hierarchy's mount point)}."""
    paths = parse_proc_cgroup(proc_cgroup)
    out: dict[str, tuple[Path, Path]] = {}
    for m in parse_mountinfo(mountinfo):
        if m.fstype == "cgroup2" and "" in paths and "cgroup-v2" not in out:
            out["cgroup-v2"] = (_under_mount(m, paths[""]), Path(m.mount_point))
        elif m.fstype == "cgroup" and "memory" in m.super_options and "memory" in paths:
            out["cgroup-v1"] = (_under_mount(m, paths["memory"]), Path(m.mount_point))
    return out


def _ancestors(leaf: Path, stop: Path) -> Iterable[Path]:
    """leaf, its parent, ... up to and including the mount point `stop`."""
    d = leaf
    while True:
        yield d
        if d == stop or d.parent == d or stop not in d.parents:
            return
        d = d.parent


# -- sources --------------------------------------------------------------------------------


def _read(path: Path) -> str:
    return path.read_text()


class CgroupProbe:
    """The tightest limit among a cgroup and its ancestors (a parent's limit binds children)."""

    FILES = {
        "cgroup-v2": ("memory.max", "memory.current"),
        "cgroup-v1": ("memory.limit_in_bytes", "memory.usage_in_bytes"),
    }

    def __init__(self, source: str, leaf: Path, mount_point: Path) -> None:
        self.source = source
        self.limit_file, self.usage_file = self.FILES[source]
        self.dirs = [d for d in _ancestors(leaf, mount_point) if (d / self.limit_file).is_file()]

    def limited_dirs(self) -> list[Path]:
        out = []
        for d in self.dirs:
            try:
                if parse_limit(_read(d / self.limit_file)) is not None:
                    out.append(d)
            except (OSError, ValueError):
                continue
        return out

    def read(self) -> MemoryReading:
        best: MemoryReading | None = None
        for d in self.dirs:
            try:
                limit = parse_limit(_read(d / self.limit_file))
                if limit is None:
                    continue
                usage = int(_read(d / self.usage_file).strip())
                stat = parse_memory_stat(_read(d / "memory.stat"))
            except (OSError, ValueError):
                continue
            r = MemoryReading(self.source, limit, working_set(usage, stat), detail=str(d))
            if best is None or r.available_bytes < best.available_bytes:
                best = r
        if best is None:  # the limit was lifted since detection: fall back to the host
            return SystemProbe().read()
        return best


class SystemProbe:
    """The host: total memory and psutil's `available` (free + reclaimable)."""

    source = "system"

    def read(self) -> MemoryReading:
        vm = psutil.virtual_memory()
        return MemoryReading(self.source, vm.total, vm.total - vm.available)


_MACOS_LEVELS = {1: "normal", 2: "warn", 4: "critical"}


def parse_macos_level(text: str) -> str | None:
    try:
        return _MACOS_LEVELS.get(int(text.strip()))
    except ValueError:
        return None


class MacOSProbe(SystemProbe):
    """psutil's numbers plus the kernel's own verdict (memorystatus pressure level)."""

    source = "macos"

    def read(self) -> MemoryReading:
        r = super().read()
        try:
            out = subprocess.run(["sysctl", "-n", "kern.memorystatus_vm_pressure_level"],
                                 capture_output=True, text=True, timeout=2).stdout  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        return MemoryReading(self.source, r.limit_bytes, r.used_bytes, parse_macos_level(out))


class ManualProbe:
    """Readings set by hand: tests, benchmarks, and simulations inject pressure with it."""

    source = "manual"

    def __init__(self, limit_bytes: int = 16 << 30, pressure: float = 0.5) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = int(pressure * limit_bytes)
        self.kernel_level: str | None = None

    def set(self, pressure: float | None = None, *, used_bytes: int | None = None,
            limit_bytes: int | None = None) -> None:  # fmt: skip
        if limit_bytes is not None:
            self.limit_bytes = limit_bytes
        if used_bytes is not None:
            self.used_bytes = used_bytes
        if pressure is not None:
            self.used_bytes = int(pressure * self.limit_bytes)

    def read(self) -> MemoryReading:
        return MemoryReading(self.source, self.limit_bytes, self.used_bytes, self.kernel_level)


def detect_probe(
    source: str = "auto",
    *,
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    mountinfo: Path = Path("/proc/self/mountinfo"),
    platform: str = sys.platform,
) -> MemoryProbe:
    """The probe for `source`; "auto" takes a cgroup that has a limit, else the host."""
    if source not in SOURCES:
        raise ValueError(f"unknown memory source {source!r}; one of {', '.join(SOURCES)}")
    if source in ("system", "macos"):
        return MacOSProbe() if source == "macos" else SystemProbe()
    try:
        found = cgroup_dirs(proc_cgroup.read_text(), mountinfo.read_text())
    except OSError:
        found = {}
    for name in ("cgroup-v2", "cgroup-v1"):
        if name not in found or source not in ("auto", name):
            continue
        probe = CgroupProbe(name, *found[name])
        if source == name or probe.limited_dirs():
            return probe
    if source != "auto":
        raise ValueError(f"memory source {source!r} is not available on this host")
    return MacOSProbe() if platform == "darwin" else SystemProbe()
