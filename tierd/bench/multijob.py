"""Section 6: two training processes sharing one daemon, each against alone.

Each job is a ``tierd.bench.worker`` (tierd mode, a small model) that warms up,
says "ready" and waits; once every job of a group is ready all start their
timed steps together, so the steps overlap.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
import time

from tierd.bench import models
from tierd.bench.common import Context, SectionTimeout, row, subprocess_env
from tierd.bench.training import need


def _spec(ctx: Context) -> dict:
    s = ctx.sizes
    big = ctx.cuda and not s.quick
    return dict(mode="tierd", model="gpt2-124m" if big else ctx.model, seq=512 if big else s.seq,
                batches=[8 if big else s.batches[0]], forward_batch=0,
                steps=(s.train_steps + 3) if big else s.train_steps, warmup=s.warmup_steps,
                profile=False, instrument=False,
                gpu_budget=(64 << 20) if big else (256 << 10),
                socket=str(ctx.start_daemon().socket), wait_go=True)


def run_group(spec: dict, n: int, timeout: float) -> list[dict]:
    """Start ``n`` jobs, release them together once all are warm, collect results."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    procs = [subprocess.Popen([sys.executable, "-m", "tierd.bench.worker", f.name],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for _ in range(n)]
    lines: queue.Queue = queue.Queue()
    readers = [threading.Thread(target=_read, args=(i, p, lines), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    results: list[dict | None] = [None] * n
    try:
        ready = 0
        while ready < n:
            i, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError(f"job {i} exited before it was ready: "
                                   f"{procs[i].stderr.read()[-1500:]}")
            ready += line.strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        done = 0
        while done < n:
            i, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                done += 1
                if results[i] is None:
                    raise RuntimeError(f"job {i} failed: {procs[i].stderr.read()[-1500:]}")
            elif line.startswith("{"):
                results[i] = json.loads(line)
    except queue.Empty:
        raise SectionTimeout(f"jobs did not finish within {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return results


def _read(i: int, proc: subprocess.Popen, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put((i, line))
    lines.put((i, None))


def run(ctx: Context) -> list[dict]:
    need(ctx, *(() if ctx.model == "torch-tiny" else ("transformers",)), cuda=False)
    spec = _spec(ctx)
    b = spec["batches"][0]
    cfg = (f"{models.describe(spec['model'])}, B={b}, T={spec['seq']}, tierd attach "
           f"(bf16, gpu_budget {spec['gpu_budget'] >> 10} KiB) + tierd.optim.AdamW, one "
           f"shared daemon, {spec['steps']} timed steps started together")
    alone = run_group(spec, 1, ctx.case_timeout())[0]["train"][str(b)]["step_s"]
    rows = [row("multi-job: one job alone", cfg, step_s=alone)]
    for n in (2,) if ctx.sizes.quick else (2, 4):
        for i, res in enumerate(run_group(spec, n, ctx.case_timeout())):
            step = res["train"][str(b)]["step_s"]
            rows.append(row(f"multi-job: job {'ABCD'[i]} of {n} at once", cfg, step_s=step,
                            ratio=step / alone, limit="the same job alone"))
    # each client is a process importing torch: the quick run starts fewer
    clients, seconds = (4, 1.0) if ctx.sizes.quick else (8, 5.0)
    rows.append(many_clients(spec["socket"], clients=clients, seconds=seconds))
    return rows


_CLIENT = """
import sys, time, torch, tierd
c = tierd.connect(sys.argv[1])
c.put("k", torch.zeros(1024))
print("ready", flush=True); sys.stdin.readline()
n, end = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    c.lease(["k"]); c.release(["k"]); n += 2
print(n, flush=True)
"""


def many_clients(socket: str, clients: int, seconds: float) -> dict:
    """Requests/s served to ``clients`` processes each doing lease/release
    round trips as fast as they can, all at once, on one daemon."""
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, socket, str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=subprocess_env()) for _ in range(clients)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a client did not start")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        total = sum(int(p.stdout.readline()) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return row(f"requests/s, {clients} clients at once",
               f"{clients} processes, each lease+release of one 4 KiB key in a loop for "
               f"{seconds:g} s, one daemon", req_per_s=total / seconds)
