"""The ``tierd`` command line: settings precedence, config errors, log format,
``top`` and ``health``, each run as a real process."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading

import msgpack
import pytest
import torch

from tests.conftest import subprocess_env, tierd_command
from tierd.cli import COMMANDS, build_parser, main
from tierd.config import ServeConfig, parse_bool, setting_kind


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


def test_print_config_needs_no_nvme_but_serving_does(tmp_path):
    proc = tierd_run("serve", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["nvme"] is None
    proc = tierd_run("serve", "--socket", str(tmp_path / "s.sock"))
    assert proc.returncode == 2 and "--nvme" in proc.stderr and "TIERD_NVME" in proc.stderr
    assert not (tmp_path / "s.sock").exists()


def test_help_lists_every_command_with_one_line_each():
    proc = tierd_run("--help")
    assert proc.returncode == 0, proc.stderr
    for cmd in COMMANDS:
        assert re.search(rf"^    {re.escape(cmd.name)} +{re.escape(cmd.summary)}$",
                         proc.stdout, re.M), cmd.name
    assert "``" not in proc.stdout


def test_every_option_of_every_command_has_help():
    sub = build_parser()._subparsers._group_actions[0]
    assert set(sub.choices) == {c.name for c in COMMANDS}
    for name, parser in sub.choices.items():
        for action in parser._actions:
            assert action.help, f"tierd {name} {action.option_strings or action.dest}"


def test_every_setting_is_settable_by_flag_variable_and_toml(tmp_path, monkeypatch, capsys):
    """Each ServeConfig field, set three ways to a value unlike its default,
    comes back from --print-config."""
    values = {name: unlike_default(name) for name in ServeConfig.field_names()}
    expect = ServeConfig(**values).as_json()
    assert all(expect[k] != v for k, v in ServeConfig().as_json().items() if k != "nvme")
    for name, value in values.items():
        toml = (f"[jobs.'a.b']\npool_quota = '1MiB'\n[jobs.c]\nnvme_quota = '3MiB'\n"
                if name == "job_quotas" else f"[serve]\n{name} = {toml_value(value)}\n")
        (tmp_path / "t.toml").write_text(toml)
        ways = {"flag": ([f"--{name.replace('_', '-')}", value], {}),
                "variable": ([], {f"TIERD_{name.upper()}": value}),
                "toml": (["--config", str(tmp_path / "t.toml")], {})}
        for way, (argv, env) in ways.items():
            for k in [k for k in os.environ if k.startswith("TIERD_")]:
                monkeypatch.delenv(k)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            assert main(["serve", "--print-config", *argv]) == 0, (name, way)
            got = json.loads(capsys.readouterr().out)[name]
            assert got == expect[name], (name, way, got)


def toml_value(text: str) -> str:
    """TOML's own types where they fit (numbers, booleans), else a string."""
    if text.isdigit():
        return text
    return {"on": "true", "off": "false"}.get(text, json.dumps(text))


#: Values for settings whose kind alone does not give a valid one.
SPECIAL = {"log_level": "DEBUG", "log_format": "json", "metrics_host": "0.0.0.0",
           "metrics_port": "9100", "job_quotas": "a.b.pool_quota=1MiB,c.nvme_quota=3MiB",
           "pool_threads": "3", "group": "trainers"}


def unlike_default(name: str) -> str:
    """Text for setting ``name`` that reads as a valid value other than its default."""
    if name in SPECIAL:
        return SPECIAL[name]
    kind, _ = setting_kind(ServeConfig, name)
    default = getattr(ServeConfig(), name)
    if kind == "bool":
        return "off" if default else "on"
    if kind in ("int", "Size"):
        return str(default + 4096 if kind == "Size" else default + 1)
    assert kind == "Path", f"add a value for {name} ({kind}) to SPECIAL"
    return f"/x/{name}"


@pytest.mark.parametrize("word,expected", [("1", True), ("0", False), ("true", True),
                                           ("False", False), ("yes", True), ("NO", False),
                                           ("on", True), ("off", False)])
def test_booleans_read_the_usual_words(word, expected):
    assert parse_bool(word) is expected
    assert ServeConfig(allow_root_join=word).allow_root_join is expected


def test_bad_boolean_and_unknown_setting_are_one_line_errors(tmp_path):
    for args, env, needle in (
            ([], {"TIERD_ALLOW_ROOT_JOIN": "maybe"}, "TIERD_ALLOW_ROOT_JOIN"),
            (["--allow-root-join=2"], {}, "--allow-root-join"),
            (["--pool-size", "1GiB"], {}, "unrecognized arguments: --pool-size 1GiB; "
                                          "see `tierd serve --help`"),
            (["--job-quotas", "a.disk=1GiB"], {}, "unknown quota 'disk'")):
        proc = tierd_run("serve", "--print-config", *args, env=env)
        assert proc.returncode == 2, (args, proc.stdout)
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    proc = print_config(tmp_path, toml="[serve]\nallow_root_join = 'perhaps'\n")
    assert proc.returncode == 2 and "allow_root_join" in proc.stderr and "on/off" in proc.stderr
    proc = print_config(tmp_path, env={"TIERD_POOL_SIZE": "1GiB"})
    assert proc.returncode == 0 and "TIERD_POOL_SIZE is not a daemon setting" in proc.stderr


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


def test_status_health_and_top_do_not_import_torch(daemon):
    code = ("import sys\nfrom tierd.cli import main\n"
            "for argv in (['status'], ['status', '--json'], ['health'], ['top', '--count', '1']):\n"
            "    assert main([*argv, '--socket', sys.argv[1]]) == 0, argv\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code, str(daemon.socket)], capture_output=True,
                          text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, tierd; tierd.TierdError; print(sorted(sys.modules))"],
        capture_output=True, text=True, env=subprocess_env(), timeout=120).stdout
    assert "'tierd'" in loaded and "'torch'" not in loaded


def test_status_lists_live_jobs_only(daemon):
    with daemon.connect(job="ended") as c:
        c.put("w", torch.zeros(1024))                 # a named job outlives its clients
    with daemon.connect(job="alive") as c:
        c.put("w", torch.zeros(256))
        proc = tierd_run("status", "--json", "--socket", str(daemon.socket))
        every = tierd_run("status", "--json", "--all", "--socket", str(daemon.socket))
        text = tierd_run("status", "--socket", str(daemon.socket))
    assert proc.returncode == every.returncode == text.returncode == 0, proc.stderr
    view = json.loads(proc.stdout)
    assert set(view["jobs"]) == {"alive"}             # not "ended", not status's own session
    assert view["idle_jobs"] == {"jobs": 1, "tensors": 1, "pool_used_bytes": 4096,
                                 "nvme_used_bytes": 0}
    assert set(json.loads(every.stdout)["jobs"]) == {"alive", "ended"}
    assert re.search(r"^alive ", text.stdout, re.M) and "\nended " not in text.stdout
    assert "and 1 job with no client, holding 1 tensors" in text.stdout
    # the largest free NVMe extent says whether fragmentation makes records span extents
    assert view["nvme_largest_free_bytes"] > 0 and "largest free extent" in text.stdout


def test_a_socket_that_is_not_tierds_is_one_line_and_exit_2(tmp_path):
    """Something else listening at the control socket: a clear line, no traceback."""
    frame = msgpack.packb({"ok": True, "x": 1})      # well formed, but no session
    replies = {"junk": struct.pack("!I", 3) + b"abc", "map": struct.pack("!I", len(frame)) + frame}
    listeners = []
    for name, reply in replies.items():
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(tmp_path / f"{name}.sock.ctl"))
        s.listen()
        listeners.append(s)
        threading.Thread(target=answer_once, args=(s, reply), daemon=True).start()
    (tmp_path / "file.sock.ctl").write_text("not a socket")
    for name in (*replies, "file"):
        proc = tierd_run("status", "--socket", str(tmp_path / f"{name}.sock"))
        assert proc.returncode == 2, (name, proc.stdout)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert str(tmp_path / f"{name}.sock") in proc.stderr, proc.stderr
        if name != "file":
            assert "is not a tierd daemon's socket" in proc.stderr, proc.stderr
    for s in listeners:
        s.close()


def answer_once(listener: socket.socket, reply: bytes) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.recv(4096)
        conn.sendall(reply)
        conn.recv(4096)                               # until the client hangs up


def test_import_of_a_bad_file_is_one_line_and_puts_nothing(daemon, tmp_path):
    from safetensors.torch import save_file
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.ones(8, dtype=torch.bfloat16), "b": torch.arange(6).view(2, 3)}, good)
    raw = good.read_bytes()
    files = {"random.safetensors": bytes(range(256)) * 4, "truncated.safetensors": raw[:-3],
             "empty.safetensors": b"",
             "dtype.safetensors": raw.replace(b'"dtype":"I64"', b'"dtype":"U16"')}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    for name in (*files, "missing.safetensors"):
        proc = tierd_run("import", str(tmp_path / name), "--job", "dst",
                         "--socket", str(daemon.socket))
        assert proc.returncode == 2, (name, proc.stdout)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert name in proc.stderr, proc.stderr
    with daemon.connect() as c:
        assert "dst" not in c.stats()["jobs"]           # nothing went in
    proc = tierd_run("import", str(good), "--job", "dst", "--socket", str(daemon.socket))
    assert proc.returncode == 0, proc.stderr
    with daemon.connect(job="dst") as c:
        assert torch.equal(c.get("a"), torch.ones(8, dtype=torch.bfloat16))
        assert torch.equal(c.get("b"), torch.arange(6).view(2, 3))


def test_export_takes_nvme_from_the_config_file(daemon, tmp_path):
    from safetensors.torch import load_file
    with daemon.connect(job="cfg") as c:
        c.put("w", torch.full((3, 5), 2.5, dtype=torch.bfloat16))
        c.commit("t1")
    (tmp_path / "t.toml").write_text(f'[serve]\nnvme = "{daemon.nvme}"\n')
    out = tmp_path / "out.safetensors"
    proc = tierd_run("export", "--job", "cfg", "--out", str(out),
                     env={"TIERD_CONFIG": str(tmp_path / "t.toml")})
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(load_file(out)["w"], torch.full((3, 5), 2.5, dtype=torch.bfloat16))
    proc = tierd_run("export", "--job", "cfg", "--out", str(out))
    assert proc.returncode == 2 and "--nvme" in proc.stderr


def test_status_says_when_commit_manifests_were_quarantined(tmp_path):
    from tests.conftest import start_daemon
    from tierd.backends.manifest import ManifestStore
    d = start_daemon(tmp_path)
    with d.connect(job="bad") as c:
        c.put("w", torch.ones(16))
        c.commit("one")
    d.stop()
    ManifestStore(d.nvme).path("bad").write_bytes(b"not a manifest")
    d = start_daemon(tmp_path)
    try:
        proc = tierd_run("status", "--socket", str(d.socket))
    finally:
        d.stop()
    assert proc.returncode == 0, proc.stderr
    assert "1 damaged commit manifests moved aside" in proc.stdout, proc.stdout
