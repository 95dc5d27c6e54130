"""Deploy fixes a cluster needs (issue 32): GPU taints tolerated, Pod Security
labels that admit the hostPaths, no NVMe file on an unmounted disk, no
restart of the daemons under running jobs, a daemon image without torch, a
systemd unit that runs the venv under /opt/tierd."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import yaml

from tests.conftest import ROOT, subprocess_env

K8S = ROOT / "deploy" / "kubernetes"


def docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((K8S / name).read_text()))


def pods() -> list[tuple[str, dict]]:
    """(namespace, pod spec) of every workload in the manifests."""
    out = []
    for name in ("daemonset.yaml", "training-job.yaml"):
        for d in docs(name):
            if d["kind"] in ("DaemonSet", "Job"):
                out.append((d["metadata"]["namespace"], d["spec"]["template"]["spec"]))
    return out


def test_pods_tolerate_the_gpu_taint_and_their_namespaces_admit_hostpaths():
    namespaces = {d["metadata"]["name"]: d for name in ("daemonset.yaml", "training-job.yaml")
                  for d in docs(name) if d["kind"] == "Namespace"}
    for ns, pod in pods():
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
            in pod["tolerations"]
        labels = namespaces[ns]["metadata"]["labels"]   # each pod's namespace is shipped
        assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_daemonset_never_restarts_daemons_under_jobs_by_itself():
    (ds,) = [d for d in docs("daemonset.yaml") if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["nvme"]["hostPath"]["type"] == "Directory"   # an unmounted disk: no file
    live = spec["containers"][0]["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 600
    assert live["timeoutSeconds"] > int(live["exec"]["command"][-1])


def test_the_daemon_image_installs_no_torch():
    text = (ROOT / "deploy" / "Containerfile").read_text()
    daemon_stage = text.split("FROM daemon AS demo")[0]
    assert "torch" not in re.sub(r"#.*", "", daemon_stage)
    assert "--no-deps" in daemon_stage
    (job,) = [d for d in docs("training-job.yaml") if d["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"].startswith(
        "ghcr.io/tierd/tierd-demo:")


def test_the_daemon_serves_where_torch_cannot_be_imported(tmp_path):
    sock = tmp_path / "t.sock"
    code = ("import sys; sys.modules['torch'] = None\n"   # `import torch` raises
            "from tierd.cli import main; sys.exit(main(sys.argv[1:]))")
    daemon = subprocess.Popen([sys.executable, "-c", code, "serve", "--nvme", str(tmp_path / "n"),
                               "--socket", str(sock), "--pool", "16MiB", "--nvme-size", "64MiB"],
                              env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:   # until it listens (or exits: then the assertion shows why)
            probe = subprocess.run([sys.executable, "-c", code, "health", "--socket", str(sock)],
                                   env=subprocess_env(), capture_output=True, text=True,
                                   timeout=60)
            if probe.returncode == 0 or daemon.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert probe.returncode == 0, probe.stderr
    finally:
        daemon.terminate()
        out = daemon.communicate(timeout=30)[0].decode()
    assert daemon.returncode == 0, out


def test_the_systemd_unit_runs_the_venv_under_opt():
    unit = (ROOT / "deploy" / "systemd" / "tierd.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(\S+)", unit, re.M)
    assert exec_start == "/opt/tierd/bin/tierd"
    assert "ProcSubset=pid" not in re.sub(r"#.*", "", unit)
