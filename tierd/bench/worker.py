"""One benchmark case in its own process: ``python -m tierd.bench.worker SPEC.json``.

Each case gets a fresh CUDA context (so peak memory is its own) and can be
killed at its timeout by ``tierd.bench.run``. The last stdout line is the JSON result.

Spec fields: ``mode`` (gpu | tierd | fsdp2 | accelerate), ``model``, ``seq``,
``batches`` (training batch sizes; empty for none), ``forward_batch`` (0 for
none), ``steps``, ``warmup``, ``socket`` (tierd), ``gpu_budget`` (tierd),
``profile`` (count PCIe bytes of one step with the profiler), ``instrument``
(time tierd's hooks and requests for one step), ``wait_go`` (multi-job: print
"ready" after warm-up and wait for a line on stdin).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from tierd.bench import models
from tierd.bench.common import median


def main(path: str) -> None:
    spec = json.load(open(path))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    mode = spec["mode"]
    setup = {"gpu": setup_gpu, "tierd": setup_tierd, "fsdp2": setup_fsdp2,
             "accelerate": setup_accelerate}[mode]
    t0 = time.perf_counter()
    model, opt, extra = setup(spec, device)
    out = {"mode": mode, "device": str(device), "setup_s": time.perf_counter() - t0,
           "params": extra.pop("params"), "train": {}, **extra}
    for b in spec.get("batches", []):
        out["train"][str(b)] = measure_train(spec, model, opt, b, device)
        print(json.dumps(out), flush=True)   # partial results survive a timeout
    if spec.get("forward_batch"):
        if mode == "gpu":   # forward-only reference: the same model in bf16
            opt = None
            model = model.to(torch.bfloat16)
        out["forward"] = measure_forward(spec, model, spec["forward_batch"], device)
    out["complete"] = True
    print(json.dumps(out), flush=True)


# ------------------------------------------------------------------ setups
def setup_gpu(spec, device):
    model = models.build(spec["model"], spec["seq"], device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                            fused=device.type == "cuda")
    return model, opt, {"params": models.n_params(model)}


def setup_tierd(spec, device):
    import tierd
    model = models.build(spec["model"], spec["seq"], device).cpu()
    _empty_cache(device)
    params = models.n_params(model)
    client = tierd.connect(spec["socket"])
    tierd.attach(model, client=client, compute_dtype="bf16",
                 gpu_budget_bytes=spec["gpu_budget"])
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return model, opt, {"params": params, "gpu_budget": spec["gpu_budget"]}


def setup_fsdp2(spec, device):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    if device.type != "cuda":
        raise SystemExit("fsdp2 needs CUDA")
    torch.cuda.set_device(device)
    store = dist.FileStore(tempfile.mktemp(prefix="bench-fsdp-"), 1)
    dist.init_process_group("cuda:nccl,cpu:gloo", store=store, rank=0, world_size=1)
    model = models.build(spec["model"], spec["seq"], device).cpu()
    _empty_cache(device)
    policy = CPUOffloadPolicy(pin_memory=True)
    for block in model.transformer.h:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)   # on CPU
    return model, opt, {"params": models.n_params(model)}


def setup_accelerate(spec, device):
    from accelerate import cpu_offload
    model = models.build(spec["model"], spec["seq"], device).to(torch.bfloat16).cpu().eval()
    _empty_cache(device)
    cpu_offload(model, execution_device=device)
    return model, None, {"params": models.n_params(model)}


def _empty_cache(device) -> None:
    """The model was built on the GPU (fast init) and moved off: give the memory back."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- measuring
def measure_train(spec, model, opt, b, device) -> dict:
    ids = models.batch(spec["model"], b, spec["seq"], device)
    for _ in range(spec["warmup"]):
        models.train_step(model, opt, ids, device)
    if spec.get("wait_go"):
        print("ready", flush=True)
        sys.stdin.readline()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [models.train_step(model, opt, ids, device) for _ in range(spec["steps"])]
    out = {"step_s": median(times), "steps_s": times,
           "tokens_per_s": b * spec["seq"] / median(times)}
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    if spec.get("profile") and device.type == "cuda":
        out.update(pcie_bytes(lambda: models.train_step(model, opt, ids, device)))
    if spec.get("instrument") and spec["mode"] == "tierd":
        out["control"] = control_share(model, opt, ids, device)
    return out


def measure_forward(spec, model, b, device) -> dict:
    ids = models.batch(spec["model"], b, spec["seq"], device)
    for _ in range(spec["warmup"] + 1):
        models.forward_step(model, ids, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [models.forward_step(model, ids, device) for _ in range(spec["steps"] + 2)]
    out = {"step_s": median(times), "steps_s": times, "batch": b,
           "tokens_per_s": b * spec["seq"] / median(times)}
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        if spec.get("profile"):
            out.update(pcie_bytes(lambda: models.forward_step(model, ids, device)))
    return out


def pcie_bytes(step) -> dict:
    """Host<->device bytes of one ``step``, summed from the profiler's memcpy events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
    fd, trace = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(trace)
        events = json.load(open(trace)).get("traceEvents", [])
    finally:
        os.unlink(trace)
    h2d = d2h = 0
    for e in events:
        if e.get("cat") != "gpu_memcpy":
            continue
        n = int(e.get("args", {}).get("bytes", 0))
        if "HtoD" in e.get("name", ""):
            h2d += n
        elif "DtoH" in e.get("name", ""):
            d2h += n
    return {"h2d_bytes": h2d, "d2h_bytes": d2h, "bytes_source": "profiler memcpy events"}


def control_share(model, opt, ids, device) -> dict:
    """One instrumented step: host time inside tierd's hook bodies and in
    requests made outside them (the optimizer's), as shares of that step."""
    from tierd.client.attach import session_of
    session = session_of(model)
    timer = HookTimer(session)
    try:
        models.train_step(model, opt, ids, device)    # wrappers warm
        timer.reset()
        waited = session.stats()["wait_seconds"]
        step = models.train_step(model, opt, ids, device)
        waited = session.stats()["wait_seconds"] - waited
    finally:
        timer.remove()
    return {"step_s": step, "hook_s": timer.hook_s, "hook_calls": timer.hook_calls,
            "requests": timer.requests, "request_s_outside_hooks": timer.req_outside_s,
            "wait_s": waited,
            # the hooks' own work: their time less what they spent blocked on
            # copies, replies and collectives (waits in step() count too: a lower bound)
            "hook_work_share": max(0.0, timer.hook_s - waited) / step,
            "hook_share": timer.hook_s / step,
            "control_share": (timer.hook_s + timer.req_outside_s) / step,
            "method": "the session's hook_seconds over one step; the client's _submit/_wait "
                      "wrapped on the instance, outside the hooks wrapped there (on_grad's "
                      "requests count as outside) (host wall time)"}


class HookTimer:
    """Times the attach session's hook entry points and the client's requests
    by shadowing them with instance attributes (nothing global is patched).

    The session's hook methods that its hooks look up at each call are
    wrapped, and the end-of-backward callback through the session's
    BackwardTracker. ``on_grad`` cannot be: it runs from a weak method hook
    bound at attach, so requests made inside it count as outside the hooks;
    the hook time (``hook_s``) is the session's own ``hook_seconds``, which
    every hook body adds to."""

    HOOKS = ("begin_step", "pre_forward", "post_forward", "pre_backward")

    def __init__(self, session) -> None:
        self._session = session
        self._targets = [(session, n, n) for n in self.HOOKS] + \
            [(session.backward, "_on_end", "end_backward"),
             (session.client, "_submit", "_submit"), (session.client, "_wait", "_wait")]
        self._saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in self._targets]
        self._depth = 0
        self.reset()
        for obj, name, label in self._targets:
            setattr(obj, name, self._wrap(getattr(obj, name), label))

    def reset(self) -> None:
        self._hook_s0 = self._session.stats()["hook_seconds"]
        self.req_outside_s = 0.0
        self.hook_calls = self.requests = 0

    @property
    def hook_s(self) -> float:
        return self._session.stats()["hook_seconds"] - self._hook_s0

    def remove(self) -> None:
        for obj, name, before in self._saved:
            if before is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)

    def _wrap(self, fn, label):
        is_hook = label in self.HOOKS or label == "end_backward"

        def timed(*args, **kwargs):
            outer = self._depth == 0
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self._depth -= 1
                if label == "_submit":
                    self.requests += 1
                if outer and is_hook:
                    self.hook_calls += 1
                elif outer:
                    self.req_outside_s += dt
        return timed


if __name__ == "__main__":
    main(sys.argv[1])
