"""The ``tierd`` command line: settings precedence, config errors, log format,
``top`` and ``health``, each run as a real process."""

from __future__ import annotations

import json
import subprocess

import torch

from tests.conftest import subprocess_env, tierd_command


def tierd_run(*args: str, env: dict | None = None, timeout: float = 60):
    base = {k: v for k, v in subprocess_env().items() if not k.startswith("TIERD_")}
    return subprocess.run(tierd_command(*args), capture_output=True, text=True,
                          env=dict(base, **(env or {})), timeout=timeout)


def print_config(tmp_path, *flags: str, env: dict | None = None, toml: str | None = None):
    args = ["serve", "--print-config", "--nvme", str(tmp_path / "nvme"), *flags]
    if toml is not None:
        (tmp_path / "tierd.toml").write_text(toml)
        args += ["--config", str(tmp_path / "tierd.toml")]
    return tierd_run(*args, env=env)


def test_flag_beats_env_beats_file_beats_default(tmp_path):
    toml = ('[serve]\npool = "8MiB"\nio-threads = 3\nmax_requests = 100\n'
            'segment_size = "1MiB"\nlog_format = "json"\n')
    env = {"TIERD_POOL": "16MiB", "TIERD_IO_THREADS": "5", "TIERD_ALLOW_ROOT_JOIN": "false"}
    proc = print_config(tmp_path, "--pool", "32MiB", env=env, toml=toml)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["pool"] == 32 << 20                  # flag over env and file
    assert cfg["io_threads"] == 5                   # env over file
    assert cfg["allow_root_join"] is False          # env over default
    assert cfg["max_requests"] == 100 and cfg["segment_size"] == 1 << 20   # file over default
    assert cfg["log_format"] == "json"
    assert cfg["max_requests_per_client"] == 256    # default
    assert cfg["metrics_port"] is None and cfg["metrics_host"] == "127.0.0.1"


def test_metrics_and_log_flags_fill_the_config(tmp_path):
    proc = print_config(tmp_path, "--metrics-port", "9400", "--metrics-host", "0.0.0.0",
                        "--log-format", "json", env={"TIERD_METRICS_PORT": "9500"})
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert (cfg["metrics_port"], cfg["metrics_host"], cfg["log_format"]) == \
        (9400, "0.0.0.0", "json")
    proc = print_config(tmp_path, env={"TIERD_METRICS_PORT": "9500"})
    assert json.loads(proc.stdout)["metrics_port"] == 9500


def test_unknown_toml_key_is_a_clear_error(tmp_path):
    proc = print_config(tmp_path, toml='[serve]\npool = "8MiB"\npool_size = "1GiB"\n')
    assert proc.returncode == 2
    assert "unknown [serve] settings ['pool_size']" in proc.stderr
    assert "known:" in proc.stderr and "Traceback" not in proc.stderr


def test_malformed_toml_and_bad_values_are_clear_errors(tmp_path):
    proc = print_config(tmp_path, toml="[serve\npool = 1\n")
    assert proc.returncode == 2 and "tierd.toml" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = print_config(tmp_path, env={"TIERD_LOG_FORMAT": "xml"})
    assert proc.returncode == 2 and "log_format" in proc.stderr and "json" in proc.stderr
    proc = print_config(tmp_path, env={"TIERD_METRICS_PORT": "http"})
    assert proc.returncode == 2 and "metrics_port" in proc.stderr
    proc = print_config(tmp_path, "--pool", "lots")
    assert proc.returncode == 2 and "64MiB" in proc.stderr


def test_missing_nvme_names_the_flag(tmp_path):
    proc = tierd_run("serve", "--print-config")
    assert proc.returncode == 2 and "--nvme" in proc.stderr


def test_json_log_format_writes_one_object_per_line(daemon_factory):
    d = daemon_factory(extra=("--log-format", "json"))
    d.stop()
    lines = [json.loads(line) for line in d.output().splitlines() if line.strip()]
    messages = [line["message"] for line in lines]
    assert any(m.startswith("tierd serving at") for m in messages), messages
    assert "tierd stopped" in messages
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)


def test_health_exits_0_for_a_live_daemon_and_1_without_one(daemon, tmp_path):
    proc = tierd_run("health", "--socket", str(daemon.socket))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok:")
    proc = tierd_run("health", "--socket", str(tmp_path / "none.sock"))
    assert proc.returncode == 1 and "unhealthy" in proc.stderr
    daemon.stop()
    proc = tierd_run("health", "--socket", str(daemon.socket))
    assert proc.returncode == 1, proc.stdout


def test_health_uses_tierd_socket_from_the_environment(daemon):
    proc = tierd_run("health", env={"TIERD_SOCKET": str(daemon.socket)})
    assert proc.returncode == 0, proc.stderr


def test_top_refreshes_count_times_with_rates(daemon):
    with daemon.connect(job="top-test") as c:
        c.put("x", torch.zeros(4096))
        proc = tierd_run("top", "--socket", str(daemon.socket), "--count", "3",
                         "--interval", "0.05")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tierd top") == 3
    assert proc.stdout.count("rate ") == 2          # from the second refresh on
    assert proc.stdout.count("\ntop-test ") == 3     # the jobs table, each time


def test_top_and_status_fail_without_a_daemon(tmp_path):
    for cmd in ("top", "status"):
        proc = tierd_run(cmd, "--socket", str(tmp_path / "none.sock"), "--count", "1"
                         ) if cmd == "top" else tierd_run(cmd, "--socket", str(tmp_path / "x"))
        assert proc.returncode == 2 and "no tierd daemon" in proc.stderr
