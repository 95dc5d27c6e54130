"""kill -9 the daemon at random points during writes and commits, then restart.

After every restart the job must hold exactly one commit's tensors, bit for
bit: the last commit that was acknowledged, or the one in flight when the
daemon died (its manifest may have landed before the reply was sent). Nothing
written after a commit, and no tensor of an unacknowledged commit that did not
land, may show up.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from tierd.errors import DaemonUnavailable, TierdError
from tests.faults import harness

ROUNDS = 52
JOB = "crashy"


def tensor(rng: random.Random) -> torch.Tensor:
    n = rng.choice([1, 100, 1024, 5000, 1 << 16, 1 << 18])
    return torch.randint(-1 << 31, 1 << 31, (n,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(rng.getrandbits(32)))


class Writer:
    """One client's random puts, deletes, evictions and commits; remembers
    what each commit should hold."""

    def __init__(self, client, rng: random.Random, acked: tuple[str, dict]) -> None:
        self.client, self.rng = client, rng
        self.live: dict[str, torch.Tensor] = dict(acked[1])
        self.acked = acked                  # (tag, {key: tensor}) of the last acked commit
        self.pending: tuple[str, dict] | None = None
        self.commit_started = threading.Event()

    def run(self, tag_prefix: str) -> None:
        try:
            for i in range(10_000):
                self.step(f"{tag_prefix}-{i}")
        except (DaemonUnavailable, TimeoutError):
            return
        except TierdError as exc:
            if "went away" not in str(exc):
                raise

    def step(self, tag: str) -> None:
        c, rng = self.client, self.rng
        op = rng.random()
        if op < 0.55 or not self.live:
            batch = {f"k{rng.randrange(24)}": tensor(rng) for _ in range(rng.randint(1, 4))}
            c.put_many(batch)
            self.live.update(batch)
        elif op < 0.65:
            key = rng.choice(sorted(self.live))
            c.delete(key)
            del self.live[key]
        elif op < 0.75:
            c.evict(rng.sample(sorted(self.live), min(3, len(self.live))))
        else:
            self.pending = (tag, dict(self.live))
            self.commit_started.set()
            c.commit(tag)
            self.acked, self.pending = self.pending, None


def check_restart(d: harness.Daemon, acked: tuple[str, dict],
                  pending: tuple[str, dict] | None) -> tuple[tuple[str, dict], int]:
    """The commit the restarted daemon shows, checked bit for bit; bytes read."""
    with d.connect(job=JOB) as c:
        tags = c.commits()
        candidates = {acked[0]: acked} | ({pending[0]: pending} if pending else {})
        shown = tags[-1] if tags else ""
        assert shown in candidates, (f"restart shows commit {shown!r}; expected one of "
                                     f"{sorted(candidates)}")
        tag, expect = candidates[shown]
        assert sorted(c.keys()) == sorted(expect), f"keys of commit {tag!r} differ"
        got = c.get_many(sorted(expect)) if expect else {}
        for key, t in expect.items():
            assert torch.equal(got[key], t), f"{key} of commit {tag!r} differs"
        return (tag, expect), sum(t.nbytes for t in expect.values())


def test_kill_9_during_writes_and_commits_loses_no_commit(tmp_path):
    rng = random.Random(20261129)
    acked: tuple[str, dict] = ("", {})
    pending = None
    kills = verified = commits_seen = 0
    d = harness.start(tmp_path)
    for round_ in range(ROUNDS):
        client = d.connect(job=JOB)
        w = Writer(client, rng, acked)
        thread = threading.Thread(target=w.run, args=(f"r{round_}",), daemon=True)
        thread.start()
        if round_ % 2:   # aim at a commit: die a few ms into one
            w.commit_started.wait(5)
            time.sleep(rng.uniform(0, 0.01))
        else:            # anywhere in the stream of writes
            time.sleep(rng.uniform(0.01, 0.25))
        d.kill()
        kills += 1
        thread.join(10)
        assert not thread.is_alive(), "the client hung after the daemon died"
        client.close()
        acked, pending = w.acked, w.pending
        d = harness.start(tmp_path)
        acked, nbytes = check_restart(d, acked, pending)
        verified += nbytes
        commits_seen += bool(acked[0])
    d.stop()
    print(f"\n{kills} kill -9 points, {verified} committed bytes verified bit-exact "
          f"after restarts ({commits_seen} restarts showed a commit)")
    assert commits_seen >= ROUNDS // 2
