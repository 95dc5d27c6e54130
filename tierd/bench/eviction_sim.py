"""What the daemon's eviction and read-ahead move for a frozen model streamed
through a pool smaller than it, without a GPU or a daemon process.

    python -m tierd.bench.eviction_sim --out DIR                 # the 70B LoRA at 24 GB
    python -m tierd.bench.eviction_sim --out DIR --nvme-gb 37    # a file the size of the spill
    python -m tierd.bench.eviction_sim --out DIR --rank 16       # the catalog's entries, its cost
    python -m tierd.bench.eviction_sim --out DIR --layers 74 --rank 16 --disk-gbps 1.8   # timed

The daemon's own catalog runs in this process over a real pool and NVMe
file, every size divided by ``--scale``; transfers are accounted as done
the moment they start (no bytes move, no clock), so what comes out is the
policy's traffic, not its speed: the bytes read from NVMe a step, of them
the ones read ahead of their lease, and the bytes written. With
``--disk-gbps`` there is a clock: each transfer takes its bytes over that
rate, one after another in the order the catalog started them, and the GPU
holds each block it leases ``--gpu-s`` seconds; each step then also says
its seconds, the disk's busy seconds and the seconds the job waited on
leases (what the policy leaves the disk to do, without the daemon's own
CPU time or the client's). The step is the
one a checkpointed LoRA step asks of the daemon: each decoder block's
frozen weights leased in order for the forward, in reverse for the
backward (each block re-run, then its gradients: one position), and the
adapters' optimizer state stored anew. With ``--plan`` the access plan is
told and each position reached ([Note: the job's access plan] in
``tierd.server.readahead``); without it, least recently used at lease time.
``--plan-from 2`` tells it at the third step, as the client does (its
prefetch planner learns the order first): the blocks the first steps
spilled keep cycling, and the disk idles mid-step as on the H200 (the
README's 70B section).

Figures are printed and written to ``DIR/eviction-sim.json`` in full-scale
GB, with the CPU seconds the step spent in the catalog (``catalog_s``: what
the daemon's loop would spend, [Note: the catalog's cost on the loop] in
``tierd.server.catalog``). What it showed first: Belady's order with a spill-sized file wrote
28-37 GB a step of read-only weights, as the H200 run wrote 12.3 GB
([Note: what reading ahead writes] in ``tierd.server.readahead``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tierd.backends.hostpool import HostPool
from tierd.backends.nvme import NvmeStore
from tierd.protocol import TensorSpec
from tierd.server.catalog import Blocked, Catalog

GB = 1e9


@dataclass(frozen=True)
class Block:
    """A decoder block's tensors (bf16), by name, as its lease names them:
    Llama-3-70B's frozen weights; with ``rank`` > 0 also its norms and LoRA
    adapters of that rank on q/k/v/o. Those small tensors are most of the
    catalog's entries, so they make its cost, not its traffic (scaled down,
    each takes a page of the pool: a few % of it at 1/1024)."""

    hidden: int = 8192
    mlp: int = 28672
    kv: int = 1024
    rank: int = 0

    def keys(self) -> dict[str, int]:
        h, f, kv, r = self.hidden, self.mlp, self.kv, self.rank
        out = {"q": 2 * h * h, "k": 2 * h * kv, "v": 2 * h * kv, "o": 2 * h * h,
               "gate": 2 * h * f, "up": 2 * h * f, "down": 2 * f * h}
        if r:
            out["input_norm"] = out["post_norm"] = 2 * h
            for name, width in (("q", h), ("k", kv), ("v", kv), ("o", h)):
                out[f"{name}.lora_A"], out[f"{name}.lora_B"] = 2 * r * h, 2 * width * r
        return out

    def adapters(self) -> list[str]:
        return [k for k in self.keys() if "lora" in k]


class Simulation:
    """The catalog, its pool and NVMe file, and one job's session; with a
    ``disk_rate`` (bytes a second, this scale's), a clock: each transfer
    takes its bytes over the rate, one after another in the order started."""

    def __init__(self, pool_bytes: int, nvme_bytes: int, segment_bytes: int, where: Path,
                 disk_rate: float | None = None):
        self.pool = HostPool(pool_bytes, segment_size=segment_bytes)
        self.nvme = NvmeStore(where, nvme_bytes)
        self.catalog = Catalog(self.pool, self.nvme)
        self.session = self.catalog.open_session(1, "job", pid=1, uid=0)
        self.rate = disk_rate
        self.clock = 0.0        # seconds
        self.disk_free = 0.0    # when the disk has done all it was given
        self.disk_busy = 0.0    # seconds of transfers given to it
        self.waited = 0.0       # seconds the job waited on leases and reserves
        self.in_flight: list[tuple[float, object]] = []

    def close(self) -> None:
        self.pool.close()
        self.nvme.close()

    def start(self) -> None:
        """Give the disk the transfers the catalog started (no clock: done at once)."""
        for t in self.catalog.take_started():
            if self.rate is None:
                self.catalog.finish(t, None)
                continue
            self.disk_free = max(self.disk_free, self.clock) + t.nbytes / self.rate
            self.disk_busy += t.nbytes / self.rate
            self.in_flight.append((self.disk_free, t))

    def run_until(self, when: float) -> None:
        """The clock moves to ``when``; transfers done by then finish."""
        self.start()
        done = [(at, t) for at, t in self.in_flight if at <= when]
        self.in_flight = [(at, t) for at, t in self.in_flight if at > when]
        for _, t in sorted(done, key=lambda d: d[0]):
            self.catalog.finish(t, None)
        self.clock = max(self.clock, when)

    def wait(self) -> None:
        """A request is blocked: until the next transfer finishes."""
        self.start()
        if self.rate is None or not self.in_flight:
            return
        before = self.clock
        self.run_until(min(at for at, _ in self.in_flight))
        self.waited += self.clock - before

    def put(self, key: str, nbytes: int) -> None:
        spec = TensorSpec(key, "uint8", (nbytes,), nbytes)
        while isinstance(self.catalog.reserve(self.session, (spec,)), Blocked):
            self.wait()
        self.start()
        self.catalog.publish(self.session, (key,))

    def use(self, keys: tuple[str, ...], seconds: float = 0.0) -> None:
        """Lease ``keys``, hold them ``seconds`` (the GPU's time on them), release."""
        while isinstance(self.catalog.lease(self.session, keys, False), Blocked):
            self.wait()
        self.run_until(self.clock + seconds)
        self.catalog.release(self.session, keys, False)

    def counters(self) -> dict[str, int]:
        c = self.catalog.tiers.counters
        return {"read": c.bytes_to_pool, "ahead": c.bytes_read_ahead, "written": c.bytes_to_nvme}


def run(args) -> list[dict]:
    """Per step: bytes read from NVMe, of them ahead, and written (full
    scale), and the seconds this process spent in the catalog."""
    scale, block = args.scale, Block(rank=args.rank)
    sizes = {k: n // scale for k, n in block.keys().items()}
    blocks = [tuple(f"layers/{i}/{k}" for k in sizes) for i in range(args.layers)]
    # the adapters' optimizer state, stored anew each step (masters, moments)
    state = [f"state/{i}/{k}" for i in range(args.layers) for k in block.adapters()] or ["state"]
    state_bytes = max(1, int(args.state_gb * GB) // scale // len(state))
    order = list(range(args.layers)) + list(range(args.layers - 1, -1, -1))
    rate = None if args.disk_gbps is None else args.disk_gbps * GB / scale
    with tempfile.TemporaryDirectory() as where:
        sim = Simulation(int(args.pool_gb * GB) // scale, int(args.nvme_gb * GB) // scale,
                         (256 << 20) // scale, Path(where), rate)
        try:
            for keys in blocks:
                for key in keys:
                    sim.put(key, sizes[key.rsplit("/", 1)[1]])
            rows, at = [], 0
            for step in range(args.steps):
                planned = args.plan and step >= args.plan_from
                if planned and step == args.plan_from:
                    sim.catalog.use_plan(sim.session, "model", tuple(blocks[u] for u in order))
                before, began = sim.counters(), time.process_time()
                clock, busy, waited = sim.clock, sim.disk_busy, sim.waited
                for u in order:
                    if planned:
                        sim.catalog.use_at(sim.session, "model", at)
                        sim.start()
                    at += 1
                    sim.use(blocks[u], args.gpu_s)
                for key in state:
                    sim.put(key, state_bytes)
                after = sim.counters()
                rows.append({"step": step, **{f"{k}_gb": (after[k] - before[k]) * scale / GB
                                              for k in after},
                             "catalog_s": time.process_time() - began})
                if rate is not None:
                    rows[-1].update(step_s=sim.clock - clock, disk_s=sim.disk_busy - busy,
                                    waited_s=sim.waited - waited)
            return rows
        finally:
            sim.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--pool-gb", type=float, default=112.75, help="the H200 run's pool")
    ap.add_argument("--nvme-gb", type=float, default=56.0,
                    help="the NVMe file (the embedded daemon's on the H200's disk)")
    ap.add_argument("--state-gb", type=float, default=1.2,
                    help="the adapters' state stored anew each step")
    ap.add_argument("--rank", type=int, default=0,
                    help="LoRA rank: blocks with norms and adapters, the state split over "
                         "the adapters (0: the frozen weights only, one state tensor)")
    ap.add_argument("--disk-gbps", type=float, default=None,
                    help="a clock: transfers take their bytes over this rate, one at a time "
                         "(default: none, every transfer done when started)")
    ap.add_argument("--gpu-s", type=float, default=0.04,
                    help="with --disk-gbps: the GPU's seconds on each block it leases")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1024, help="every size divided by this")
    ap.add_argument("--plan", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--plan-from", type=int, default=0,
                    help="the step the plan is first told at (the client: its third, once "
                         "its prefetch planner follows the learned order)")
    args = ap.parse_args(argv)
    if args.rank < 0:
        ap.error(f"--rank must be at least 0, not {args.rank}")
    if args.plan_from < 0:
        ap.error(f"--plan-from must be at least 0, not {args.plan_from}")
    for name in ("layers", "steps", "scale"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    rows = run(args)
    for r in rows:
        print(f"step {r['step']}: read {r['read_gb']:.1f} GB ({r['ahead_gb']:.1f} ahead), "
              f"written {r['written_gb']:.1f} GB; {r['catalog_s']:.2f} s in the catalog"
              + ("" if "step_s" not in r else f"; clock: step {r['step_s']:.1f} s, disk "
                 f"{r['disk_s']:.1f} s, waited {r['waited_s']:.1f} s"))
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eviction-sim.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
