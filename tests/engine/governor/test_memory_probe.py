"""Memory probes: cgroup v1/v2 parsing and detection on fake files, the psutil fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen3_tts_engine.governor.memory import (
    CgroupProbe,
    MacOSProbe,
    ManualProbe,
    SystemProbe,
    detect_probe,
    parse_limit,
    parse_macos_level,
    parse_memory_stat,
    parse_mountinfo,
    parse_proc_cgroup,
    working_set,
)

MB = 1 << 20

MOUNTINFO = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
30 1 0:26 / / rw,relatime shared:1 - overlay overlay rw,lowerdir=/a
33 25 0:28 / {tmp}/fs/cgroup rw,nosuid - tmpfs tmpfs ro,mode=755
34 33 0:29 / {tmp}/fs/cgroup/unified rw,nosuid,nodev shared:10 - cgroup2 cgroup2 rw,nsdelegate
36 33 0:31 / {tmp}/fs/cgroup/cpu rw,nosuid shared:12 - cgroup cgroup rw,cpu
37 33 0:32 {root} {tmp}/fs/cgroup/memory rw,nosuid shared:13 - cgroup cgroup rw,memory
"""


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(text)


def _proc(tmp: Path, cgroup: str, root: str = "/") -> tuple[Path, Path]:
    (tmp / "proc").mkdir(exist_ok=True)
    (tmp / "proc" / "cgroup").write_text(cgroup)
    (tmp / "proc" / "mountinfo").write_text(MOUNTINFO.format(tmp=tmp, root=root))
    return tmp / "proc" / "cgroup", tmp / "proc" / "mountinfo"


# -- parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("max\n", None), ("", None), ("9223372036854771712\n", None), ("104857600\n", 104857600),
])  # fmt: skip
def test_parse_limit(text, expected):
    assert parse_limit(text) == expected


def test_parse_memory_stat_and_working_set():
    v1 = parse_memory_stat("cache 300\nrss 700\ntotal_inactive_file 200\ninactive_file 50\n")
    assert working_set(1000, v1) == 800  # v1 hierarchical counter wins
    v2 = parse_memory_stat("anon 700\nfile 300\ninactive_file 120\n")
    assert working_set(1000, v2) == 880
    assert working_set(100, {"inactive_file": 500}) == 0


def test_parse_proc_cgroup_v1_and_v2_lines():
    text = "12:cpu,cpuacct:/x\n4:memory:/process_api/abc\n0::/user.slice/app\n"
    assert parse_proc_cgroup(text) == {"cpu": "/x", "cpuacct": "/x", "memory": "/process_api/abc",
                                       "": "/user.slice/app"}  # fmt: skip


def test_parse_mountinfo_finds_cgroup_mounts(tmp_path):
    mounts = parse_mountinfo(MOUNTINFO.format(tmp=tmp_path, root="/"))
    kinds = {(m.fstype, m.mount_point) for m in mounts}
    assert ("cgroup2", f"{tmp_path}/fs/cgroup/unified") in kinds
    memory = [m for m in mounts if "memory" in m.super_options]
    assert memory[0].fstype == "cgroup" and memory[0].root == "/"


@pytest.mark.parametrize(("text", "level"), [("1\n", "normal"), ("2", "warn"), ("4", "critical"),
                                             ("", None), ("x", None)])  # fmt: skip
def test_parse_macos_level(text, level):
    assert parse_macos_level(text) == level


# -- detection on fake hierarchies -------------------------------------------------------------


def test_cgroup_v2_limit_on_a_parent_binds(tmp_path):
    base = tmp_path / "fs/cgroup/unified"
    _write(base / "kubepods/pod1", memory__max="1073741824\n", memory__current=str(700 * MB),
           memory__stat=f"anon 1\ninactive_file {100 * MB}\n")  # fmt: skip
    _write(base / "kubepods/pod1/ctr", memory__max="max\n", memory__current=str(650 * MB),
           memory__stat="inactive_file 0\n")  # fmt: skip
    cgroup, mountinfo = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    probe = detect_probe(proc_cgroup=cgroup, mountinfo=mountinfo, platform="linux")
    assert isinstance(probe, CgroupProbe) and probe.source == "cgroup-v2"
    r = probe.read()
    assert (r.limit_bytes, r.used_bytes) == (1 << 30, 600 * MB)
    assert r.detail.endswith("kubepods/pod1") and r.pressure == pytest.approx(600 / 1024)


def test_cgroup_v1_without_a_namespace_and_the_tightest_level_wins(tmp_path):
    # The mount shows /docker/abc itself (no cgroup namespace): our path maps to its top.
    base = tmp_path / "fs/cgroup/memory"
    _write(base, memory__limit_in_bytes=str(2048 * MB), memory__usage_in_bytes=str(1000 * MB),
           memory__stat="total_inactive_file 0\n")  # fmt: skip
    _write(base / "worker", memory__limit_in_bytes=str(600 * MB),
           memory__usage_in_bytes=str(500 * MB), memory__stat=f"total_inactive_file {20 * MB}\n")  # fmt: skip
    cgroup, mountinfo = _proc(tmp_path, "4:memory:/docker/abc/worker\n0::/\n", root="/docker/abc")
    probe = detect_probe(proc_cgroup=cgroup, mountinfo=mountinfo, platform="linux")
    assert probe.source == "cgroup-v1"
    r = probe.read()
    # worker: 600 - 480 = 120 MB left; the top: 2048 - 1000 = 1048 MB left -> worker binds.
    assert (r.limit_bytes, r.used_bytes, r.available_bytes) == (600 * MB, 480 * MB, 120 * MB)


def test_no_limit_anywhere_falls_back_to_the_host(tmp_path):
    base = tmp_path / "fs/cgroup/memory"
    _write(base / "a", memory__limit_in_bytes="9223372036854771712\n",
           memory__usage_in_bytes="1\n", memory__stat="")  # fmt: skip
    _write(tmp_path / "fs/cgroup/unified/a", memory__max="max\n", memory__current="1\n",
           memory__stat="")  # fmt: skip
    cgroup, mountinfo = _proc(tmp_path, "4:memory:/a\n0::/a\n")
    linux = detect_probe(proc_cgroup=cgroup, mountinfo=mountinfo, platform="linux")
    assert type(linux) is SystemProbe
    assert (
        type(detect_probe(proc_cgroup=cgroup, mountinfo=mountinfo, platform="darwin")) is MacOSProbe
    )
    r = linux.read()
    assert r.source == "system" and 0 < r.used_bytes < r.limit_bytes and 0 < r.pressure < 1


def test_a_requested_source_that_is_missing_is_an_error(tmp_path):
    cgroup, mountinfo = _proc(tmp_path, "4:memory:/a\n")
    with pytest.raises(ValueError, match="not available"):
        detect_probe("cgroup-v2", proc_cgroup=cgroup, mountinfo=tmp_path / "nothing")
    with pytest.raises(ValueError, match="unknown memory source"):
        detect_probe("swap")


def test_the_real_host_gives_a_sane_reading():
    r = detect_probe().read()
    assert r.limit_bytes > 0 and 0 <= r.used_bytes and r.source in ("cgroup-v2", "cgroup-v1",
                                                                      "system", "macos")  # fmt: skip


def test_manual_probe_sets_pressure_or_bytes():
    p = ManualProbe(limit_bytes=1000, pressure=0.5)
    assert p.read().used_bytes == 500
    p.set(0.9)
    assert p.read().pressure == pytest.approx(0.9)
    p.set(used_bytes=100, limit_bytes=200)
    assert p.read().available_bytes == 100


def test_on_a_mac_auto_is_the_macos_probe_with_the_kernels_level(tmp_path, monkeypatch):
    """A Mac has no /proc: `auto` (the governor's and `qwen3-tts serve`'s default) takes the macOS
    probe, which adds the kernel's pressure level from sysctl (a stand-in here) to psutil's."""
    probe = detect_probe(proc_cgroup=tmp_path / "proc/cgroup", mountinfo=tmp_path / "proc/mountinfo",
                         platform="darwin")  # fmt: skip
    assert type(probe) is MacOSProbe
    sysctl = tmp_path / "bin" / "sysctl"
    sysctl.parent.mkdir()
    sysctl.write_text('#!/bin/sh\n[ "$*" = "-n kern.memorystatus_vm_pressure_level" ] && echo 2\n')
    sysctl.chmod(0o755)
    monkeypatch.setenv("PATH", str(sysctl.parent))
    r = probe.read()
    assert (r.source, r.kernel_level) == ("macos", "warn") and 0 < r.pressure < 1
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no sysctl: psutil's numbers alone
    assert probe.read().kernel_level is None
