"""deploy/: the systemd unit, the Kubernetes manifests, the Containerfile and the
sample config are checked against tierd itself (its config loader, a live daemon)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tierd.config import ServeConfig, load_toml, parse_size
from tests.conftest import ROOT, subprocess_env

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "tierd.service"


def unit_settings(text: str) -> dict[str, str]:
    settings = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def daemonset() -> tuple[dict, dict]:
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" /
                                                      "daemonset.yaml").read_text())}
    return docs["DaemonSet"], docs["ConfigMap"]


def k8s_bytes(quantity: str) -> int:
    return parse_size(re.sub(r"([KMGT])i$", r"\1iB", quantity))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    # verify insists the ExecStart binary exists: point it at this checkout's tierd.
    exe = shutil.which("tierd") or str(Path(sys.executable).with_name("tierd"))
    if not Path(exe).exists():
        exe = str(tmp_path / "tierd")
        Path(exe).write_text("#!/bin/sh\nexit 0\n")
        Path(exe).chmod(0o755)
    unit = tmp_path / "tierd.service"
    unit.write_text(UNIT.read_text().replace("/opt/tierd/bin/tierd", exe))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)
    complaints = [line for line in proc.stderr.splitlines() if "tierd.service" in line]
    assert proc.returncode == 0 and not complaints, proc.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_unit_exposure_is_at_most_4():
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)],
                          capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for tierd.service: ([0-9.]+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) <= 4.0, proc.stdout


def test_unit_settings_that_matter():
    s = unit_settings(UNIT.read_text())
    assert s["LimitMEMLOCK"] == "infinity"
    assert s["Restart"] == "on-failure"             # a crashed or OOM-killed daemon comes back
    assert (s["Type"], s["NotifyAccess"]) == ("notify", "main")
    assert "PrivateUsers" not in s                  # would turn the jobs' uids into nobody
    socket = re.search(r"--socket (\S+)", s["ExecStart"]).group(1)
    assert Path(socket).parent == Path("/run") / s["RuntimeDirectory"]
    assert "--config /etc/tierd/tierd.toml" in s["ExecStart"]
    assert s["KillSignal"] == "SIGTERM"


def test_unit_serves_its_own_group_through_a_directory_it_may_search():
    """Jobs run as their own users in the unit's group: the daemon serves
    Group= (so it needs no chown, which ~@privileged forbids), and the
    runtime directory lets that group search it but not write it."""
    s = unit_settings(UNIT.read_text())
    assert re.search(r"--group (\S+)", s["ExecStart"]).group(1) == s["Group"]
    assert s["RuntimeDirectoryMode"] == "0750"
    assert "~@privileged" in UNIT.read_text()


def test_sample_config_and_configmap_load_into_serve_config(tmp_path):
    for text in ((DEPLOY / "tierd.toml").read_text(), daemonset()[1]["data"]["tierd.toml"]):
        path = tmp_path / "tierd.toml"
        path.write_text(text)
        cfg = ServeConfig(**load_toml(path))     # unknown keys would raise here
        assert cfg.socket == Path("/run/tierd/tierd.sock")


def test_daemonset_mounts_probes_and_resources_agree_with_its_config(tmp_path):
    ds, cm = daemonset()
    (tmp_path / "tierd.toml").write_text(cm["data"]["tierd.toml"])
    cfg = ServeConfig(**load_toml(tmp_path / "tierd.toml"))
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert "hostPath" in mounts[str(cfg.nvme)]                  # NVMe dir on the node
    assert "hostPath" in mounts[str(cfg.socket.parent)]         # socket shared with jobs
    assert mounts["/etc/tierd"]["configMap"]["name"] == cm["metadata"]["name"]
    assert c["args"] == ["serve", "--config", "/etc/tierd/tierd.toml"]
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["tierd", "health"] and str(cfg.socket) in probe
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert k8s_bytes(limits["memory"]) >= cfg.pool           # memfd pages count here
    assert requests["memory"] == limits["memory"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= \
        ds["spec"]["template"]["metadata"]["labels"].items()


def test_containerfile_copies_what_exists_and_probes_with_health():
    text = (DEPLOY / "Containerfile").read_text()
    for line in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for src in line.split():
            assert (ROOT / src).exists(), src
    assert 'ENTRYPOINT ["tierd"]' in text
    assert re.search(r'^HEALTHCHECK .*CMD \["tierd", "health"', text, re.M)


def test_probe_command_against_a_daemon_started_from_the_sample_config(daemon_factory):
    # flags (socket, nvme, sizes, port) override the file, as on a real node
    d = daemon_factory(extra=("--config", str(DEPLOY / "tierd.toml"), "--metrics-port", "0"))
    ds, _ = daemonset()
    probe = ds["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    argv = [str(d.socket) if a == "/run/tierd/tierd.sock" else a for a in probe[1:]]
    run = lambda: subprocess.run([sys.executable, "-m", "tierd", *argv], env=subprocess_env(),
                                 capture_output=True, text=True, timeout=60)
    assert run().returncode == 0
    assert '"message": "tierd serving at' in d.output()       # log_format = "json" applied
    d.stop()
    assert run().returncode == 1
