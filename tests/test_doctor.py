"""``tierd doctor``: one verdict per check; the daemon part without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import tierd
from tests.backends.test_memory import fake_root
from tests.conftest import ROOT, subprocess_env
from tierd import doctor

GiB = 1 << 30


def run_doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom tierd.cli import main\nrc = main(sys.argv[1:])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "doctor", *args], cwd=ROOT,
                          env={**subprocess_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=60)


def test_daemon_part_reports_the_daemon_without_importing_torch(daemon, tmp_path):
    proc = run_doctor("--daemon-only", "--json", "--socket", str(daemon.socket),
                      "--nvme", str(tmp_path / "nvme"))
    assert proc.returncode == 0, proc.stderr
    assert "no torch" in proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["socket"]["detail"].startswith(f"{daemon.socket} (given as an argument")
    assert checks["daemon"]["verdict"] == "ok"
    assert checks["daemon"]["detail"].startswith(f"tierd {tierd.__version__}, pool 64.0 MiB")
    assert str(tmp_path) in checks["NVMe O_DIRECT"]["detail"]
    assert {"tierd", "memlock", "huge pages", "memory"} <= set(checks)
    assert "torch" not in checks and "pool pinning" not in checks


def test_a_dead_tierd_socket_is_named_with_its_source(tmp_path):
    dead = tmp_path / "t.sock"
    proc = run_doctor("--daemon-only", env={"TIERD_SOCKET": str(dead)})
    lines = {line.split()[1]: line for line in proc.stdout.splitlines()}
    assert f"{dead} (set by $TIERD_SOCKET; a job fails with DaemonUnavailable" in lines["socket"]
    assert lines["daemon"].startswith("warn") and f"no tierd daemon at {dead}" in lines["daemon"]


def test_the_full_report_names_the_torch_build():
    proc = run_doctor()
    assert "torch imported" in proc.stderr
    torch_line = next(line for line in proc.stdout.splitlines() if line.split()[1] == "torch")
    import torch
    assert torch.__version__ in torch_line
    assert "pool pinning" in proc.stdout


def test_shmem_huge_pages_are_a_warning(tmp_path):
    root = tmp_path / "root"
    thp = root / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "enabled").write_text("always [madvise] never\n")
    (thp / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    assert doctor.check_thp(root) == doctor.Check("huge pages", "ok",
                                                  "enabled madvise, shmem_enabled never")
    (thp / "shmem_enabled").write_text("[always] within_size advise never deny force\n")
    assert doctor.check_thp(root).verdict == "warn"


def test_a_pool_over_the_pod_limit_is_a_warning(tmp_path):
    root = fake_root(tmp_path, cgroup="0::/pod\n", files={"pod/memory.max": f"{4 * GiB}\n",
                                                          "pod/memory.current": "0\n"})
    check = doctor.check_memory(8 * GiB, root)
    assert check.verdict == "warn" and "cgroup v2 limit 4.0 GiB" in check.detail
    assert doctor.check_memory(GiB, root).verdict == "ok"


def test_direct_io_is_tested_where_the_directory_will_be(tmp_path):
    check = doctor.check_direct_io(tmp_path / "not" / "yet")
    assert check.verdict in ("ok", "warn") and str(tmp_path) in check.detail
    assert list(tmp_path.iterdir()) == []   # its test file is gone
