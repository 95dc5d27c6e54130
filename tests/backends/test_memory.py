"""The host memory figure the pool check uses: cgroup limits (v2, v1) and no
/proc/meminfo (systemd's ProcSubset=pid), read from made-up files under a root."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import subprocess_env, tierd_command
from tierd.backends.memory import cgroup_limit, host_memory
from tierd.config import format_size

GiB, MiB = 1 << 30, 1 << 20


def fake_root(tmp_path: Path, *, meminfo: int | None = 500 * GiB, cgroup: str | None = None,
              files: dict[str, str] | None = None) -> Path:
    root = tmp_path / "root"
    (root / "proc" / "self").mkdir(parents=True)
    if meminfo is not None:
        (root / "proc" / "meminfo").write_text(
            f"MemTotal:       {2 * meminfo // 1024} kB\nMemAvailable:   {meminfo // 1024} kB\n")
    if cgroup is not None:
        (root / "proc" / "self" / "cgroup").write_text(cgroup)
    for rel, text in (files or {}).items():
        path = root / "sys" / "fs" / "cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_pod_limit_wins_over_the_node_memory(tmp_path):
    root = fake_root(tmp_path, cgroup="0::/kubepods/pod1/c1\n", files={
        "kubepods/pod1/c1/memory.max": "max\n",
        "kubepods/pod1/c1/memory.current": f"{100 * MiB}\n",
        "kubepods/pod1/memory.max": f"{4 * GiB}\n",
        "kubepods/pod1/memory.current": f"{GiB}\n",
        "kubepods/pod1/memory.stat": f"anon {768 * MiB}\ninactive_file {256 * MiB}\n",
        "kubepods/memory.max": "max\n"})
    mem = host_memory(root)
    assert mem.available == 4 * GiB - (GiB - 256 * MiB)
    assert mem.source.startswith("cgroup v2 limit 4.0 GiB at ")
    assert "kubepods/pod1/memory.max" in mem.source and mem.machine == 500 * GiB


def test_no_cgroup_limit_reads_memavailable(tmp_path):
    root = fake_root(tmp_path, meminfo=23 * GiB, cgroup="0::/system.slice/tierd.service\n",
                     files={"system.slice/tierd.service/memory.max": "max\n",
                            "system.slice/memory.max": "max\n"})
    mem = host_memory(root)
    assert mem.available == 23 * GiB and mem.cgroup is None
    assert mem.source == f"MemAvailable in {root}/proc/meminfo"


def test_cgroup_v1_limit(tmp_path):
    root = fake_root(tmp_path, cgroup="5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
                     files={"memory/docker/abc/memory.limit_in_bytes": f"{2 * GiB}\n",
                            "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
                            "memory/docker/abc/memory.stat": "total_inactive_file 0\n"})
    mem = host_memory(root)
    assert mem.available == GiB and mem.source.startswith("cgroup v1 limit 2.0 GiB")


def test_cgroup_v1_unlimited_and_a_host_path_outside_the_mount(tmp_path):
    # a container without a cgroup namespace: /proc/self/cgroup names the host's
    # path, the mount holds only the container's own cgroup
    root = fake_root(tmp_path, cgroup="4:memory:/kubepods/besteffort/pod9/c\n",
                     files={"memory/memory.limit_in_bytes": f"{3 * GiB}\n",
                            "memory/memory.usage_in_bytes": "0\n"})
    assert cgroup_limit(root).limit == 3 * GiB
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_limit(root) is None and host_memory(root).available == 500 * GiB


def test_without_proc_meminfo_the_figure_is_not_unlimited(tmp_path):
    mem = host_memory(fake_root(tmp_path, meminfo=None))   # ProcSubset=pid hides it
    assert 0 < mem.available < 1 << 62
    assert "sysinfo()" in mem.source and "ProcSubset=pid" in mem.source


def test_serve_refuses_a_pool_over_the_figure_and_names_its_source(tmp_path):
    too_big = host_memory().available + 64 * GiB
    proc = subprocess.run(tierd_command("serve", "--nvme", str(tmp_path / "nvme"), "--socket",
                                        str(tmp_path / "t.sock"), "--pool", str(too_big)),
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"--pool {format_size(too_big)} exceeds available memory" in proc.stderr
    assert host_memory().source.split(" ")[0] in proc.stderr
