"""The package a user installs: ``python -m build`` makes an sdist and, from
it, a wheel holding only ``tierd``; installed into a new virtual environment
with no source tree on its path, the wheel runs ``tierd --version``,
``tierd bench --quick``, and a tiny model attached to ``tierd serve`` from the
same install.

[Note: the installed environment]
A new venv that pip-installs torch copies ~900 MB and took a minute here, most
of this test's budget. ``--system-site-packages`` does not help: the tests run
in a venv, and the base interpreter's site-packages lacks torch (and where it
has things, it could hold another tierd). So the new venv gets the wheel
installed by pip with ``--no-deps``, and for each dependency the wheel's
metadata declares, and theirs in turn, a symlink to that distribution's files
in the environment running the tests. The new venv then holds the wheel and
exactly what it asks for: a module missing from the wheel, or an import of an
undeclared package, fails here. The tests' own tierd (a source tree or an
editable install) is never linked: it is not a dependency of itself, and the
outer environment's ``.pth`` files are not read by the new venv.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tierd
from tests.conftest import ROOT

SECTIONS = ["limits", "dataplane", "training", "forward", "control", "multijob"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The sdist and wheel ``python -m build`` makes from this tree."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> dict:
    """A new venv with the wheel installed and its dependencies linked in; the
    environment to run its commands with (no PYTHONPATH, its bin/ first)."""
    root = tmp_path_factory.mktemp("venv")
    # no PYTHONPATH even for pip: a source tree on it (with the tierd.egg-info
    # the build leaves there) reads to pip as tierd already installed
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TIERD_SOCKET")}
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")],
                   check=True, timeout=120, env=env)
    python = root / "env" / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
                           str(built["wheel"])], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True, env=env).stdout.strip())
    assert (site / "tierd" / "__init__.py").exists(), "pip did not install the wheel"
    link_requirements(site, wheel_requirements(built["wheel"]))
    env.update(PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
               XDG_CACHE_HOME=str(root / "cache"), XDG_RUNTIME_DIR=str(root / "run"))
    (root / "run").mkdir(mode=0o700)
    return {"python": python, "bin": python.parent, "site": site, "env": env, "cwd": root}


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [Requirement(line.split(":", 1)[1].strip()) for line in lines
            if line.startswith("Requires-Dist:")]


def link_requirements(site: Path, wanted: list[Requirement]) -> None:
    """Symlink into ``site`` each required distribution (not extras), and
    theirs, from the running environment (see [Note: the installed environment])."""
    seen: set[str] = set()
    while wanted:
        req = wanted.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"the wheel requires {req}, which the test environment lacks")
        top = {Path(f).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}
        for entry in top:
            target = site / entry
            if not target.exists():   # namespace dirs shared by two distributions: once
                target.symlink_to(Path(dist.locate_file(entry)).resolve())
        wanted += [Requirement(r) for r in dist.requires or ()]


def run(venv: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=venv["cwd"], env=venv["env"], capture_output=True,
                          text=True, timeout=timeout)


def test_the_wheel_holds_only_tierd_and_the_sdist_what_a_user_needs(built):
    with zipfile.ZipFile(built["wheel"]) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"tierd", f"tierd-{tierd.__version__}.dist-info"}, tops
    assert "tierd/bench/run.py" in names and "tierd/bench/worker.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    with tarfile.open(built["sdist"]) as t:
        files = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml"} <= files
    assert {"deploy/Containerfile", "docs/architecture.md", "tierd/bench/run.py"} <= files
    assert not any(f.startswith("benchmarks/") for f in files)   # results are data


def test_installed_version_is_the_source_version(venv):
    proc = run(venv, str(venv["bin"] / "tierd"), "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tierd {tierd.__version__}"
    where = run(venv, str(venv["python"]), "-c", "import tierd; print(tierd.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(venv["site"]), where.stdout + where.stderr


def test_bench_quick_runs_from_the_installed_package(venv):
    out = venv["cwd"] / "bench-out"
    # a budget for a 2-core machine under a test run's load: the multi-job
    # section starts processes that each import torch (a timeout fails the run)
    proc = run(venv, str(venv["bin"] / "tierd"), "bench", "--quick", "--budget-s", "150",
               "--out", str(out), "--nvme", str(venv["cwd"] / "bench-nvme"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("*-quick.json")
    results = json.loads(path.read_text())
    assert list(results["sections"]) == SECTIONS
    for name, section in results["sections"].items():
        assert section["status"] in ("ok", "skipped"), (name, section)
        assert f"] {name}: {section['status']}" in proc.stderr   # progress, one line each
    assert results["sections"]["limits"]["rows"] and results["sections"]["dataplane"]["rows"]
    assert results["meta"]["tierd"] == tierd.__version__
    assert results["meta"]["command"].startswith("tierd bench --quick")
    assert "== 1 limits" in proc.stdout and "== 6 multi-job" in proc.stdout
    assert path.with_suffix(".md").read_text().startswith("| section |")


ATTACH = """
import copy, json, torch, tierd
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
ref = copy.deepcopy(model)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
tierd.attach(model)                     # the daemon at $TIERD_SOCKET
opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for step in range(3):
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (ref, ref_opt)):
        loss = m(x).square().mean()
        loss.backward(); o.step(); o.zero_grad()
        losses.append(loss.item())
state = model.state_dict()
print(json.dumps({"losses": losses, "jobs": len(tierd.connect().stats()["jobs"]),
                  "equal": all(torch.equal(state[k], v) for k, v in ref.state_dict().items())}))
tierd.detach(model)
"""


def test_a_tiny_model_attaches_to_the_installed_daemon(venv):
    tmp = venv["cwd"] / "serve"
    sock = tmp / "tierd.sock"
    daemon = subprocess.Popen(
        [str(venv["bin"] / "tierd"), "serve", "--nvme", str(tmp / "nvme"), "--socket", str(sock),
         "--pool", "64MiB", "--nvme-size", "256MiB", "--segment-size", "16MiB"],
        cwd=venv["cwd"], env=venv["env"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 60
        while run(venv, str(venv["bin"] / "tierd"), "health", "--socket", str(sock)).returncode:
            assert daemon.poll() is None and time.monotonic() < deadline, \
                daemon.stderr.read() if daemon.poll() is not None else "daemon did not answer"
            time.sleep(0.2)
        proc = run(venv | {"env": venv["env"] | {"TIERD_SOCKET": str(sock)}},
                   str(venv["python"]), "-c", ATTACH)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["jobs"] >= 1, "the model's tensors are not in the daemon"
    assert result["losses"][0::2] == result["losses"][1::2]   # tierd's steps match torch's
    assert result["equal"]
