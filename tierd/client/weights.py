"""Checkpoint values for ``tierd.attach(model, weights=PATH)``, read on demand.

A :class:`CheckpointReader` opens a ``.safetensors`` file or a Hugging Face
checkpoint directory (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) and hands out one tensor at a time;
:func:`plan_load` matches the model's names against it as
``load_state_dict`` would and checks every shape and dtype before anything is
stored, so a bad checkpoint fails with the model untouched.

[Note: loading without materialising]
The registry asks a :class:`WeightsPlan` for each parameter's value while it
uploads one module at a time (``ParamRegistry._take``): a value is read from
its file (a mapping of its bytes, see [Note: reading a tensor]), converted to
the parameter's dtype (in the copy into the pool where that is exact), and
dropped once stored. The store asks for a module's values only a bounded
number of bytes ahead of its copies ([Note: pipelined puts] in
``tierd.client.connection``), so the process holds the values of a few
modules at once, never the model, and a model built on the meta device
(``with torch.device("meta"):``) can be larger than host memory.

[Note: buffers of a meta model]
Persistent buffers are in the checkpoint and are loaded from it. Non-persistent
ones (rotary ``inv_freq``, GPT-2's ``bias``) are not: a meta model's are
recomputed by the model's own ``_init_weights`` (transformers 5.x re-creates
them there, as its ``from_pretrained`` does) on a placeholder CPU tensor
(NaN-filled where the dtype has NaN); one it neither replaced nor wrote (the
tensor's version counter is unchanged) is taken from a new
``type(model)(model.config)`` built with parameters on meta and buffers on
the CPU (transformers 4.x computes them only in ``__init__``, and its
``from_pretrained`` never puts buffers on meta). A buffer still unset, or a
model without ``_init_weights``, is an error naming the buffers: build such
models with the buffers on the CPU (e.g. ``accelerate.init_empty_weights()``,
which puts only parameters on meta). ``attach(init=True)`` re-creates every
meta buffer, persistent ones too, the same way (:class:`ReplacedBuffers`),
each by the init its module gets there (``tierd.client.init_weights``).
"""

from __future__ import annotations

import copy
import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_SHOWN = 5   # names listed per kind in an error

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


#: (from, to) dtype pairs whose conversion is exact: every value of the first
#: is one of the second, so converting straight to a third dtype gives what
#: converting through the second would.
_EXACT = frozenset((src, dst) for src in (torch.bfloat16, torch.float16)
                   for dst in (torch.float32, torch.float64)) | {(torch.float32, torch.float64)}


def listed(names: list[str]) -> str:
    """Up to a few of ``names`` for an error, and how many there are."""
    head = ", ".join(names[:_SHOWN])
    return f"{head}, ... ({len(names)} in all)" if len(names) > _SHOWN else head


def _read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data begins."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _past_end(path: Path) -> list[str]:
    """Tensors of a safetensors file whose bytes lie past its end (truncated)."""
    try:
        header, base = _read_header(path)
        size = path.stat().st_size - base
    except (OSError, ValueError):
        return []
    return sorted(k for k, v in header.items() if v["data_offsets"][1] > size)


def _entries(path: Path) -> dict[str, "_Entry"]:
    """The tensors of one file, checked by ``safe_open`` (header, coverage,
    offsets) whose mapping is dropped right after: values are read one at a
    time, see [Note: reading a tensor]."""
    try:
        names = set(safe_open(str(path), framework="pt").keys())
        header, base = _read_header(path)
    except (SafetensorError, OSError, ValueError) as e:
        cut = _past_end(path)
        what = f"; tensors past its end: {listed(cut)}" if cut else ""
        raise ValueError(f"cannot read safetensors file {path}: {e}{what} "
                         "(truncated or not a safetensors file?)") from e
    return {k: _Entry(path, v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0],
                      base + v["data_offsets"][1]) for k, v in header.items() if k in names}


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype_name: str          # as safetensors spells it
    shape: tuple[int, ...]
    begin: int               # byte offsets in the file
    end: int


def _mapped(file: Path, begin: int, end: int) -> torch.Tensor:
    """A uint8 tensor over bytes ``[begin, end)`` of ``file``, mapped (private,
    copy-on-write: the file never changes); unmapped when the tensor is freed.
    ValueError when the file is now shorter than that."""
    if end == begin:
        return torch.empty(0, dtype=torch.uint8)
    start = begin - begin % mmap.ALLOCATIONGRANULARITY
    with open(file, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size < end:
            raise ValueError(f"the file ends {end - size} bytes early")
        mm = mmap.mmap(f.fileno(), end - start, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    # read ahead now, from the disk's queue, what the copy will touch
    mm.madvise(mmap.MADV_WILLNEED)
    # the tensor's storage holds the mapping (a memoryview of it) until freed
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8)[begin - start:]


class CheckpointReader:
    """The tensors of a safetensors checkpoint by name, read one at a time.

    [Note: reading a tensor]
    ``safe_open(...).get_tensor`` returns a view of the file's mapping: every
    page read stays in the process's resident set (as file pages) until the
    handle is dropped, so a load through open handles shows the whole
    checkpoint in the process's RSS. The reader instead keeps only the
    headers and maps one tensor's bytes at a time (private, read ahead with
    MADV_WILLNEED); the store copies from that mapping straight into the pool,
    converting on the way, and the mapping goes with the tensor, once the
    module is stored: the process holds what it is storing (as page-cache
    pages, no private memory), the page cache the rest. It replaced a
    ``pread`` into a new anonymous buffer, which wrote every byte twice and
    faulted in the buffer's pages: from a cached file into a mapped pool on
    the CI machine, 8 GB/s against 1.9 GB/s. A file cut short after it was
    checked is an error naming the tensor; one cut short during the copy
    (another process truncating the checkpoint mid-load) ends the process
    with SIGBUS, as any mapping does.

    Example:
        >>> with CheckpointReader("ckpt/") as r:                  # doctest: +SKIP
        ...     r.shape("lm_head.weight"), r.tensor("lm_head.weight").dtype
        ((32000, 4096), torch.bfloat16)
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._where: dict[str, _Entry] = {}   # tensor name -> where its bytes are
        for file, names in self._layout().items():
            entries = _entries(file)
            for name in names if names is not None else sorted(entries):
                if name not in entries:
                    raise ValueError(f"{file} does not hold tensor {name!r}, which "
                                     f"{self.path / INDEX_NAME} places there")
                self._where[name] = entries[name]
    def _layout(self) -> dict[Path, list[str] | None]:
        """file -> the names it must hold (None: whatever it holds)."""
        p = self.path
        if p.is_file():
            return {p: None}
        if not p.is_dir():
            raise ValueError(f"weights={str(p)!r}: no such file or directory; pass a "
                             ".safetensors file or a Hugging Face checkpoint directory")
        index = p / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a safetensors index (no valid "
                                 f"'weight_map'): {e}") from e
            files: dict[Path, list[str]] = {}
            for name, shard in weight_map.items():
                files.setdefault(p / shard, []).append(name)
            for file, names in files.items():
                if not file.is_file():
                    raise ValueError(f"checkpoint {p}: shard {file} is missing; {index} "
                                     f"places {len(names)} tensors there, e.g. {names[0]!r}")
            return files
        if (p / SINGLE_NAME).is_file():
            return {p / SINGLE_NAME: None}
        raise ValueError(f"checkpoint directory {p} has neither {INDEX_NAME} nor "
                         f"{SINGLE_NAME}")

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between reads; kept for ``with``."""

    def names(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> Path:
        return self._where[name].file

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape

    def dtype_name(self, name: str) -> str:
        """The stored dtype as safetensors spells it ("F32", "BF16", "I64", ...)."""
        return self._where[name].dtype_name

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype (None for one torch has no dtype for)."""
        return _DTYPES.get(self.dtype_name(name))

    def tensor(self, name: str) -> torch.Tensor:
        """A CPU tensor with the stored value, over a private mapping of the
        file ([Note: reading a tensor])."""
        e = self._where[name]
        dtype = self.dtype(name)
        try:
            raw = _mapped(e.file, e.begin, e.end)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read tensor {name!r} from {e.file}: {err}") from err
        if raw.storage_offset() % dtype.itemsize:   # the file does not align it
            raw = raw.clone()
        return raw.view(dtype).reshape(e.shape)


def _state_names(model: nn.Module):
    """(qualified name, module, attribute, tensor, kind) for every parameter
    holder (tied ones too) and every buffer; kind is "param", "buffer" or
    "non-persistent"."""
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in module._parameters.items():
            if p is not None:
                yield prefix + attr, module, attr, p, "param"
        for attr, b in module._buffers.items():
            if b is not None:
                kind = "non-persistent" if attr in module._non_persistent_buffers_set else "buffer"
                yield prefix + attr, module, attr, b, kind


class ReplacedBuffers:
    """Buffers given new values on a model (checkpoint values, re-created
    ones), kept so that a failed attach puts the old ones back
    (:meth:`restore`)."""

    def __init__(self) -> None:
        self._undo: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._aliases: list[tuple[nn.Module, str, torch.Tensor]] = []

    def replace(self, module: nn.Module, attr: str, value: torch.Tensor) -> None:
        self._undo.append((module, attr, module._buffers[attr]))
        module._buffers[attr] = value

    def recreate(self, model: nn.Module, targets: list[tuple[nn.Module, str, str]],
                 init: Callable[[nn.Module], None]) -> None:
        """Give the meta buffers ``targets`` (module, attribute, qualified
        name) the values ``init(module)`` of their modules, or else a model
        built from its config computes ([Note: buffers of a meta model]);
        ValueError naming those still unset."""
        owners, placeholders = {}, {}
        for module, attr, name in targets:
            old = module._buffers[attr]
            # NaN where it can be: a wrong read of one shows; set or not is told
            # by the version counter (a bool buffer has no NaN)
            fill = float("nan") if old.dtype.is_floating_point else 0
            placeholders[name] = torch.full(old.shape, fill, dtype=old.dtype)
            self.replace(module, attr, placeholders[name])
            owners[id(module)] = module
        with torch.no_grad():
            for module in owners.values():
                init(module)

        def unset():
            return [(module, attr, name) for module, attr, name in targets
                    if module._buffers[attr] is placeholders[name]
                    and placeholders[name]._version == 0]
        if unset():
            _rebuilt_buffers(model, unset())
        if unset():
            raise ValueError(
                f"{type(model).__name__}'s init did not re-create the buffers "
                f"{listed([n for _, _, n in unset()])} of the meta model; build it with "
                "buffers on the CPU (e.g. accelerate.init_empty_weights())")
        for module, attr, name in targets:   # plain attributes aliasing the old buffer
            old = next(o for m, a, o in self._undo if m is module and a == attr)
            for key, value in list(vars(module).items()):
                if value is old:   # (4.x rotary's original_inv_freq)
                    self._aliases.append((module, key, old))
                    object.__setattr__(module, key, module._buffers[attr])

    def restore(self) -> None:
        """Put back every buffer replaced (a failed attach)."""
        for module, attr, old in reversed(self._undo):
            module._buffers[attr] = old
        for module, key, old in self._aliases:
            object.__setattr__(module, key, old)
        self._undo.clear()
        self._aliases.clear()


@dataclass
class WeightsPlan:
    """Which checkpoint tensor gives each parameter and buffer its value.

    Made by :func:`plan_load` (everything checked); the registry calls it
    with each parameter (``plan(param)``) for the value to store.
    """

    reader: CheckpointReader
    params: dict[int, str] = field(default_factory=dict)    # id(param) -> checkpoint name
    buffers: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # module, attr, name
    recreate: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # non-persistent, meta
    replaced: ReplacedBuffers = field(default_factory=ReplacedBuffers)

    def __call__(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s value from the checkpoint (its own when not there and
        not strict): a tensor whose values, in ``param``'s dtype, are the
        parameter's. It keeps the file's dtype when converting to
        ``param``'s loses nothing (a bf16 file for an fp32 model): the store
        converts while copying into the pool, with no converted copy first."""
        name = self.params.get(id(param))
        if name is None:
            return param.detach()
        value = self.reader.tensor(name)
        if (value.dtype, param.dtype) in _EXACT or value.dtype == param.dtype:
            return value
        return value.to(param.dtype)   # rounds as load_state_dict would

    def load_buffers(self, model: nn.Module) -> None:
        """Give the model its checkpoint buffers and re-create a meta model's
        non-persistent ones ([Note: buffers of a meta model]); undone by
        :meth:`restore_buffers`."""
        for module, attr, name in self.buffers:
            old = module._buffers[attr]
            device = torch.device("cpu") if old.is_meta else old.device
            # a copy: a buffer lives on, a mapping of the file must not
            self.replaced.replace(module, attr,
                                  self.reader.tensor(name).to(old.dtype).to(device, copy=True))
        if not self.recreate:
            return
        init = getattr(model, "_init_weights", None)
        if not callable(init):
            raise ValueError(
                f"{type(model).__name__} was built on the meta device and its non-persistent "
                f"buffers {listed([n for _, _, n in self.recreate])} are not in checkpoints; "
                "build it with buffers on the CPU (e.g. accelerate.init_empty_weights(), which "
                "puts only parameters on meta)")
        self.replaced.recreate(model, self.recreate, init)

    def restore_buffers(self) -> None:
        """Put back the buffers :meth:`load_buffers` replaced (a failed attach)."""
        self.replaced.restore()


def _rebuilt_buffers(model: nn.Module, unset: list[tuple[nn.Module, str, str]]) -> None:
    """Give ``unset`` non-persistent buffers the values a new ``type(model)(model.config)``
    computes with parameters on meta and buffers on the CPU (transformers 4.x
    computes them in ``__init__`` only, where 5.x's ``_init_weights`` re-creates
    them too: [Note: buffers of a meta model]). Nothing for a model without a config."""
    config = getattr(model, "config", None)
    if config is None:
        return
    try:
        from transformers.integrations.accelerate import init_empty_weights
    except ImportError:
        try:
            from accelerate import init_empty_weights
        except ImportError:
            return
    try:
        with init_empty_weights(include_buffers=False):
            fresh = type(model)(copy.deepcopy(config))
    except Exception:   # not buildable from its config: the caller names the buffers
        return
    built = dict(fresh.named_buffers(remove_duplicate=False))
    for module, attr, name in unset:
        value, old = built.get(name), module._buffers[attr]
        if value is not None and not value.is_meta and value.shape == old.shape:
            module._buffers[attr] = value.to(old.dtype)


def plan_load(model: nn.Module, reader: CheckpointReader, *, strict: bool = True) -> WeightsPlan:
    """Match ``model``'s parameters and buffers to ``reader``'s tensors as
    ``load_state_dict`` would, checking names (all of them when ``strict``),
    shapes and dtypes; raises ValueError naming the file and tensors.

    A tied parameter matches any of its names (one is enough: Hugging Face
    checkpoints store ``lm_head.weight`` tied to ``transformer.wte.weight``
    once). A meta parameter or buffer must be in the checkpoint even when not
    ``strict`` (there is no other value to give it).
    """
    plan = WeightsPlan(reader)
    present = set(reader.names())
    used: set[str] = set()
    missing: list[str] = []
    by_param: dict[int, list[str]] = {}
    for name, module, attr, t, kind in _state_names(model):
        if kind == "param":
            by_param.setdefault(id(t), []).append(name)
        elif kind == "non-persistent":
            if t.is_meta:
                plan.recreate.append((module, attr, name))
        elif name in present:
            _check(reader, name, t, "buffer")
            plan.buffers.append((module, attr, name))
            used.add(name)
        elif strict or t.is_meta:
            missing.append(name)
    params = {id(p): p for p in model.parameters()}
    for pid, names in by_param.items():
        found = [n for n in names if n in present]
        used.update(found)
        if found:
            _check(reader, found[0], params[pid], "parameter")
            plan.params[pid] = found[0]
        elif strict or params[pid].is_meta:
            missing.append(names[0] if len(names) == 1 else " = ".join(names))
    unexpected = sorted(present - used) if strict else []
    if missing or unexpected:
        parts = [f"missing keys ({len(missing)}): {listed(missing)}"] if missing else []
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {listed(unexpected)}")
        raise ValueError(f"checkpoint {reader.path} does not match {type(model).__name__}: "
                         + "; ".join(parts))
    return plan


def _check(reader: CheckpointReader, name: str, t: torch.Tensor, what: str) -> None:
    shape, dtype, file = reader.shape(name), reader.dtype(name), reader.file_of(name)
    if shape != tuple(t.shape):
        raise ValueError(f"tensor {name!r} in {file} has shape {shape}, the model's "
                         f"{what} has {tuple(t.shape)}")
    if dtype is None or dtype.is_floating_point != t.is_floating_point():
        kind = "float" if t.is_floating_point() else "non-float"
        raise ValueError(f"tensor {name!r} in {file} has dtype {reader.dtype_name(name)}, "
                         f"the model's {what} is {t.dtype}: a {kind} is expected")
