"""Which of an optimizer's state keys exist: made at construction, or when
first needed; and whether the store has room for what an optimizer adds
(:func:`check_capacity`, at its construction).

[Note: state made when first needed]
A new optimizer's moments are zeros, and a parameter's are first read by
its first update. So the constructor stores none: the first update makes
them, in the store for a bucket that streams or is updated on the CPU
(:meth:`UnmadeState.ensure_stored`, with ``put_zeros``: nothing copied;
then held if the hold budget allows), on the device for one that placement
keeps resident, where they never reach the store ([Note: resident state
leaves the store] in ``tierd.updates.resident``). fp32 masters that attach did
not store ([Note: masters made when first needed] in
``tierd.client.registry``) are made the same way, cast from the compute
copy. At 8 B per parameter the moments are most of a model's training
state: an 8B model's took 55 s to write at construction. Keys a resumed job
has, or an earlier optimizer of the model left, are used or zeroed as
before, and under torch.distributed (where every rank reads the owners'
keys) the moments are made at construction. A commit stores the state that
exists; a parameter without it has never stepped, and resume makes it again.

[Note: masters cast where they are updated]
A streamed parameter's fp32 master, made by its first update, used to be
cast on the host from the stored compute copy and put (a fresh fp32 tensor,
then a copy into the pool), and then read by the update: 4 bytes a
parameter written twice by one host thread and read again over PCIe. The
Llama 13B default case on the H200 spent 7.5 s of its 10.9 s first step in
the host's update. The update reads the compute copy anyway (it writes the
new one), so ``step()`` stores such masters without bytes
(:meth:`UnmadeState.ensure_stored` with ``cast_masters``: no bytes written,
[Note: slots the update writes first]) and each update casts its master
from the compute copy it leased, where it runs, and writes it. Until that
write is queued the master is not made (``master_made`` is False: the
compute copy is the value everywhere), and a failed update deletes those it
did not write (:meth:`UnmadeState.forget_unwritten`), so no commit holds one. Under
torch.distributed, where ranks read the owners' keys, masters are made as
before. Measured on an H100 (a Llama 8.4B at its free memory, with the
update's copies back moved to the copy-out stream at the same time: [Note:
one block landing] in tierd.optim.base): the first update's host time 3.06
-> 2.77 s; the 13B case is not measured yet.

[Note: slots the update writes first]
The masters ``step()`` casts, and the moments its device update makes as
zeros (``torch.zeros_like`` on the device), are written by that update
before anything reads their stored bytes; what those bytes held is never
read. Stored as zeros (``put_zeros``) they still cost a write: the first
update frees each gradient as it is used ([Note: gradients freed as they
are used] in tierd.optim.base), so the next block's state reuses pool bytes
that held gradients, and the daemon zeroed each of them on its loop ([Note:
zero slots] in tierd.backends.hostpool): at 12 B a parameter, tens of GB in
the first ``step()`` of a 13B model, where that step's host waited 5.1 s on
the daemon's replies (H200, dd0fce3). So they are reserved and published
without bytes (:attr:`UnmadeState.cast`, :attr:`UnmadeState.blank`), stay
unmade until the update queues their writes (:meth:`UnmadeState.written`),
and a failed update deletes those it did not write
(:meth:`UnmadeState.forget_unwritten`), as it does the masters: they are
made again by the next. Moments updated on the host read their stored
bytes, and stay ``put_zeros``; so do the moments of the fused updaters,
which copy them in.
"""

from __future__ import annotations

import torch

from tierd.client.capacity import StoreNeed, device_room
from tierd.client.embedded import room_problem
from tierd.client.grads import grad_norm
from tierd.client.tiered_param import TieredParam
from tierd.errors import CapacityError, StateError
from tierd.optim.compact import CompactState


def _nbytes(like: torch.Tensor) -> int:
    return like.numel() * like.element_size()


def format_key(session) -> str:
    """The key of a compact optimizer's setting in a commit ([Note: compact
    state on resume] in tierd.optim.compact)."""
    return session.keys.state("format", "compact")


def _zero_held(session, likes: dict[str, torch.Tensor]) -> list[str]:
    """Zero held state keys in place (see :meth:`UnmadeState.create`); those
    an earlier optimizer kept in another form (a compact setting) are no
    longer held and are returned, to be made again."""
    session.settle()   # no copy out of an earlier optimizer still landing there
    keys = list(likes)
    session.leases.acquire(keys)
    try:
        views = session.leases.views(keys)
        other = [k for k, v in views.items()
                 if v.dtype != likes[k].dtype or v.numel() != likes[k].numel()]
        for k, view in views.items():
            if k not in other:
                view.zero_()
    finally:
        session.leases.release(keys, written=True)
    if other:
        session.held_bytes -= sum(_nbytes(views[k]) for k in session.leases.unhold(other))
    return other


class UnmadeState:
    """One optimizer's state keys not made yet, by key (the parameter they
    belong to), and how they are made ([Note: state made when first needed]).

    Example:
        >>> unmade = UnmadeState(opt); unmade.create(params)   # doctest: +SKIP
        >>> unmade.ensure_stored(block)    # before leasing the block's keys  # doctest: +SKIP
    """

    def __init__(self, opt) -> None:
        self.opt = opt
        self.keys: dict[str, TieredParam] = {}
        self.likes: dict[str, torch.Tensor] = {}   # key -> meta tensor of its stored form
        self._hold_later: set = set()   # sessions whose made keys are held
        #: master keys stored without bytes, to be cast from the compute copy
        #: by the update that writes them ([Note: masters cast where they are updated])
        self.cast: set[str] = set()
        #: moment keys stored without bytes, made as zeros on the device by
        #: the update that writes them ([Note: slots the update writes first])
        self.blank: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def create(self, owned: list[TieredParam]) -> None:
        """At construction: moments for every parameter of ``owned`` (but those
        a resumed attach found in the job, whose step counts are read back),
        made now only under torch.distributed or where an earlier optimizer
        left keys (zeroed); the stored ones are held if they fit."""
        opt = self.opt
        _drop_masters(opt, owned)
        existing = {session: set(session.client.keys(session.keys.all))
                    for session in opt._by_session(owned)}
        masters = {tp.master_key: tp for tp in owned if not tp.master_made
                   and opt.separate_master(tp)}
        self.keys.update(masters)
        self.likes.update({k: opt.master_like(tp) for k, tp in masters.items()})
        likes = {opt.state_key(tp, n): opt.state_like(tp, n) for tp in owned
                 for n in opt.state_names}
        for block in opt._blocks(owned):
            session = block[0].session
            fresh = {opt.state_key(tp, n): tp for tp in block for n in opt.state_names
                     if opt.state_key(tp, n) not in session.resumed_keys}
            if session.share is None:
                made_later = {k: tp for k, tp in fresh.items() if k not in existing[session]}
                self.keys.update(made_later)
                self.likes.update({k: likes[k] for k in made_later})
                fresh = {k: tp for k, tp in fresh.items() if k not in self.keys}
            # held by an earlier optimizer of this model: the held view is what
            # every update reads, so it is zeroed in place (a put would make a
            # new version behind the hold's back)
            held = [k for k in fresh if session.leases.is_held(k)
                    and k not in session.leases.shared]
            if held:
                held = [k for k in held
                        if k not in _zero_held(session, {k: likes[k] for k in held})]
            rest = {k: likes[k] for k in fresh if k not in held}
            if rest:
                session.client.put_zeros(rest)
        for session, tps in opt._by_session(owned).items():
            self._load_step_counts(session, tps)
            sizes = {opt.state_key(tp, n): _nbytes(likes[opt.state_key(tp, n)])
                     for tp in tps for n in opt.state_names}
            sizes.update({opt.master_key(tp): opt.master_nbytes(tp) for tp in tps})
            keys = {k: n for k, n in sizes.items() if not session.leases.is_held(k)}
            # all or nothing, as if every key were made now: the ones made
            # later are held as they come only if all of them fit (and are
            # counted now). Past the hold budget, try_hold ends every hold
            # when the model spills: a held key is never evicted, and the
            # compute copies held since attach would keep pool room from the
            # state that streams through NVMe (those of units whose weights
            # the GPU keeps are not read again at all)
            stored = {k: n for k, n in keys.items() if k not in self.keys}
            if session.try_hold(list(stored), sum(keys.values())):
                self._hold_later.add(session)
            mine = set(tps)
            # the first step stores every gradient, then the state made later:
            # the daemon makes their segments while the forward runs
            # ([Note: growth told ahead] in tierd.backends.hostpool)
            session.client.expect(
                [_nbytes(self.likes[k]) for k, tp in self.keys.items() if tp in mine]
                + [4 * tp.param.numel() for tp in tps if not tp.grad_in_pool])

    def _load_step_counts(self, session, tps: list[TieredParam]) -> None:
        """Step counts a commit stored ([Note: what a training commit holds] in
        tierd.client.checkpoint); a parameter without one has never stepped."""
        keys = {tp: session.keys.step_count(tp.name) for tp in tps}
        stored = [k for k in keys.values() if k in session.resumed_keys]
        if not stored:
            return
        counts = session.client.get_many(stored)
        for tp, k in keys.items():
            if k in counts and float(counts[k]) > 0:
                self.opt.state[tp.outside]["step"] = float(counts[k])

    def values(self, tps: list[TieredParam], device: torch.device, *,
               moments: bool = True) -> dict[str, torch.Tensor]:
        """The state of ``tps`` not made yet, by key, on ``device``: fp32
        masters cast from the compute copy (a resident one's device copy, else
        the store's) and (with ``moments``) zero moments; the caller stores
        them or keeps them, then calls :meth:`made`."""
        out: dict[str, torch.Tensor] = {}
        masters = [tp for tp in tps if tp.has_master and tp.master_key in self.keys]
        stored = [tp for tp in masters if not tp.resident]
        if stored:
            session = stored[0].session
            keys = [tp.key for tp in stored]
            session.leases.acquire(keys)
            try:
                views = session.leases.views(keys)
                out.update({tp.master_key: views[tp.key].to(device, torch.float32, copy=True)
                            for tp in stored})
            finally:
                session.leases.release(keys)
        out.update({tp.master_key: tp.compute.to(device, torch.float32, copy=True)
                    for tp in masters if tp.resident})
        if moments:   # zero bytes are zero moments in every form
            opt = self.opt
            out.update({k: torch.zeros(self.likes[k].shape, dtype=self.likes[k].dtype,
                                       device=device)
                        for tp in tps for n in opt.state_names
                        if (k := opt.state_key(tp, n)) in self.keys})
        return out

    def made(self, keys) -> None:
        """State keys now made (stored, or kept on the device until written back)."""
        for k in keys:
            tp = self.keys.pop(k, None)
            self.likes.pop(k, None)
            self.cast.discard(k)
            self.blank.discard(k)
            if tp is not None and k == tp.master_key:
                tp.master_made = True

    def written(self, keys) -> None:
        """The update queued the writes of ``keys``: those stored without
        bytes are made (their bytes are on their way)."""
        self.made([k for k in keys if k in self.cast or k in self.blank])

    def forget_unwritten(self) -> None:
        """An update failed: the keys stored without bytes that it did not
        write are deleted, so that no commit or read finds them (they stay
        unmade: the compute copy is the master, zeros the moments)."""
        by_session: dict = {}
        for k in self.cast | self.blank:
            by_session.setdefault(self.keys[k].session, []).append(k)
        for session, keys in by_session.items():
            session.leases.unhold(keys)
            session.client.delete(keys)
        self.cast.clear()
        self.blank.clear()

    def nbytes(self, tps: list[TieredParam]) -> int:
        """Bytes of the state of ``tps`` not made yet."""
        mine = set(tps)
        return sum(_nbytes(self.likes[k]) for k, tp in self.keys.items() if tp in mine)

    def ensure_stored(self, tps: list[TieredParam], *, cast_masters: bool = False,
                      on_device: frozenset[TieredParam] = frozenset()) -> frozenset[str]:
        """Put the state of ``tps`` not made yet, before their keys are
        leased; the moments put as zeros are returned. ``cast_masters``: the
        caller's update casts the masters of ``tps`` from their compute
        copies ([Note: masters cast where they are updated]); they are stored
        without bytes (:attr:`cast`) and made once written, but under
        torch.distributed, where ranks read the owners' keys. ``on_device``:
        of ``tps``, those whose update (the caller's) runs on the device and
        makes the moments returned there; theirs are stored without bytes
        too (:attr:`blank`, [Note: slots the update writes first])."""
        zeroed: set[str] = set()
        if not self.keys:
            return frozenset()
        for session, mine in self.opt._by_session(tps).items():
            masters = [tp for tp in mine if tp.has_master and tp.master_key in self.keys]
            cast_here = cast_masters and session.share is None
            cast = {tp.master_key: self.likes[tp.master_key] for tp in masters
                    if cast_here and tp.master_key not in self.cast}
            fresh = {} if cast_here else self.values(masters, torch.device("cpu"),
                                                       moments=False)
            wanted = set(mine)
            unwritten = self.cast | self.blank
            zeros = {k: self.likes[k] for k, tp in self.keys.items() if tp in wanted
                     and k not in fresh and k not in cast and k not in unwritten}
            blank = {k: like for k, like in zeros.items()
                     if cast_here and self.keys[k] in on_device}
            zeros = {k: like for k, like in zeros.items() if k not in blank}
            if fresh:
                session.client.put_many(fresh)
            if zeros:
                session.client.put_zeros(zeros)   # no bytes copied
            if cast or blank:   # nor zeros written: [Note: slots the update writes first]
                session.client.reserve_async({**cast, **blank}).result()
                session.client.publish_async([*cast, *blank]).result()
                self.cast.update(cast)
                self.blank.update(blank)
            zeroed.update(zeros)
            zeroed.update(blank)
            fresh.update(zeros)
            self.made(fresh)
            stored = {**fresh, **cast, **blank}
            if stored and session in self._hold_later and session.held_bytes \
                    and not session.leases.hold(stored):   # counted when planned
                session.held_bytes -= sum(_nbytes(t) for t in stored.values())
        return frozenset(zeroed)


def check_capacity(opt) -> None:
    """CapacityError, before any state is written, when a daemon cannot hold
    what ``opt`` adds: its state and the gradients of the trainable
    parameters not stored yet ([Note: what the store holds for a model] in
    tierd.client.capacity). Under torch.distributed the node holds one copy
    of every rank's share: the leader checks it all and every rank raises."""
    trainable = [tp for tp in dict.fromkeys(opt._all()) if tp.param.requires_grad]
    for session, tps in opt._by_session(trainable).items():
        ranks = session.share.ranks if session.share is not None else None
        text = None
        if ranks is None or ranks.leader:
            items = [("optimizer", opt.state_key(tp, n), _nbytes(opt.state_like(tp, n)))
                     for tp in tps for n in opt.state_names]
            items += [("gradients", tp.grad_key, tp.param.numel() * opt.grad_dtype(tp).itemsize)
                      for tp in tps]
            # made by the first update (none where the compute copy is the master)
            unmade = [tp for tp in tps if not tp.master_made and opt.separate_master(tp)]
            later = [tp.master_key for tp in unmade]
            items += [("master", tp.master_key, tp.param.numel() * 4) for tp in unmade]
            kept = opt.keeps_gradients or (
                opt.placement or session.config.optimizer_placement) == "cpu"
            need = StoreNeed.of(items, job=getattr(session.client, "job", None),
                                existing=session.client.keys(session.keys.all), later=later,
                                device=device_room(session.placer.cap if ranks is None
                                                   else None), gradients_kept=kept)
            text = room_problem(session.client, need, f"{type(opt).__name__}'s state and the "
                                f"gradients of {len(tps)} parameters", attaching=False)
        if ranks is not None:
            text = ranks.from_leader(text, "the optimizer's capacity check")
        if text:
            raise CapacityError(text)


def _drop_masters(opt, owned: list[TieredParam]) -> None:
    """Delete the fp32 masters of parameters whose compute copy is their
    master under ``master="bf16"`` ([Note: compact optimizer state] in
    tierd.optim.compact): attach stored them (a model built in fp32), or an
    earlier optimizer made them; the compute copy is their rounding."""
    for session, tps in opt._by_session(owned).items():
        stale = [tp for tp in tps if opt.master_in_compute(tp) and tp.master_made]
        if not stale:
            continue
        session.settle()
        stored = set(session.client.keys(session.keys.all))
        keys = [tp.master_key for tp in stale if tp.master_key in stored]
        if keys:
            session.drop_keys(keys, {tp.master_key: tp.param.numel() * 4 for tp in stale})
        for tp in stale:
            tp.master_made = False   # values are read from the compute copy


def set_grad_forms(opt) -> None:
    """Each of ``opt``'s parameters stores its gradient in its master's dtype
    ([Note: the stored gradient's dtype] in tierd.client.tiered_param). A key
    an earlier optimizer made in another form is deleted (the next backward
    makes it again), or, holding a gradient not used yet, stored again in
    this form (the same values, rounded where it is bf16 now)."""
    for session, tps in opt._by_session(opt._owned()).items():
        other = [tp for tp in tps if tp.grad_dtype != opt.grad_dtype(tp)]
        session.grads.spill(other)   # a sum held on the device is stored as below
        for tp in other:
            if not tp.grad_created:
                tp.grad_dtype = opt.grad_dtype(tp)
        stale = [tp for tp in other if tp.grad_created]
        if not stale:
            continue
        session.settle()
        pending = session.read([tp.grad_key for tp in stale if tp.grad_in_pool])
        session.drop_keys([tp.grad_key for tp in stale],
                          {tp.grad_key: tp.grad_nbytes for tp in stale})
        for tp in stale:
            tp.grad_dtype = opt.grad_dtype(tp)
            tp.grad_created = tp.grad_key in pending
        if pending:
            values = {tp.grad_key: pending[tp.grad_key].to(tp.grad_dtype)
                      for tp in stale if tp.grad_key in pending}
            session.client.put_many(values)
            for tp in stale:
                if tp.grad_key in values:
                    tp.to_gradient_in_pool(grad_norm(values[tp.grad_key]))


def check_compact(opt) -> None:
    """Refuse, before anything is read or written, a compact setting this
    model cannot take, or one that differs from the state a resumed job
    holds ([Note: compact state on resume] in tierd.optim.compact)."""
    owned = opt._owned()
    setting = opt.compact
    if setting.master == "bf16" and owned and not any(opt.master_in_compute(tp)
                                                      for tp in owned if tp.has_master):
        dtypes = sorted({str(tp.param.dtype) for tp in owned})
        raise ValueError(f"master='bf16' keeps bf16 parameters as their own master, and "
                         f"this optimizer's trainable parameters compute in {dtypes}; "
                         "attach with compute_dtype=torch.bfloat16, or leave master='fp32'")
    for session, tps in opt._by_session(owned).items():
        if session.share is not None and setting.master == "bf16":
            raise StateError("master='bf16' under torch.distributed is not supported: every "
                             "rank reads its owner's fp32 master from the store; use "
                             "master='fp32' (compact moments work)")
        resumed = session.resumed_keys
        key = format_key(session)
        states = [opt.state_key(tp, n) for tp in tps for n in opt.state_names]
        if key in resumed:
            stored = CompactState.from_text(bytes(session.client.get(key).tolist()).decode())
        elif any(k in resumed for k in states):
            stored = CompactState()
        else:
            stored = None
        if stored is not None and stored != setting:
            raise StateError(f"the job's commit holds {type(opt).__name__} state kept with "
                             f"{stored.text}; this optimizer keeps {setting.text}. Build it "
                             f"with {stored.text} (as the run that committed), or start a "
                             "new job: a setting is not changed on resume")
        masters = [tp.name for tp in tps if opt.master_in_compute(tp)
                   and tp.master_key in resumed]
        if masters:
            raise StateError(f"the job's commit holds fp32 masters ({masters[0]!r} and "
                             f"{len(masters) - 1} more); this optimizer keeps master='bf16'. "
                             "Build it with master='fp32', as the run that committed")
        if key not in resumed and setting.exact and key in set(session.client.keys(key)):
            session.client.delete([key])   # an earlier optimizer's, not this one's
