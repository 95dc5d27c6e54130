"""The catalog's records: tensors, transfers, sessions, jobs.

Each lifecycle is one enum whose members say where the bytes are; transitions
are the ``to_*`` methods, which begin by checking the states they accept and
raise StateError naming the key and the state. Pool slots and NVMe extents
have their own lifecycles in :mod:`tierd.server.slots`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tierd.backends.manifest import Manifest
from tierd.backends.recordio import RecordMeta
from tierd.errors import StateError
from tierd.protocol import Placement, TensorSpec
from tierd.server.slots import DiskExtent, PoolSlot


class Residency(enum.Enum):
    """Where the bytes of a key's current version are."""

    IN_POOL = "in_pool"            # readable in a pool slot; ``disk`` is a clean copy unless dirty
    WRITING_BACK = "writing_back"  # pool -> NVMe in flight; pool bytes still readable
    ON_NVME = "on_nvme"            # only on NVMe; a lease must swap it in first
    READING_IN = "reading_in"      # NVMe -> pool in flight into a slot nobody may read yet


@dataclass(eq=False)
class Entry:
    key: str
    job: str
    spec: TensorSpec
    version: int
    state: Residency
    slot: PoolSlot | None
    disk: DiskExtent | None = None
    dirty: bool = True     # pool bytes newer than ``disk``
    last_use: int = 0      # tick of its last lease; minus that of a later demote
    demoted_at: int = 0    # tick of its last demote (0: never), kept across leases
    cycle: int = 0         # ticks between its two latest demotes (0: not demoted twice)
    transfer: "Transfer | None" = None

    def meta(self) -> RecordMeta:
        """What this version's NVMe record must say ([Note: record format] in recordio)."""
        s = self.spec
        return RecordMeta(self.key, self.job, s.dtype, s.shape, s.nbytes, self.version)

    def placement(self) -> Placement:
        s = self.spec
        return Placement(self.key, self.slot.segment.id, self.slot.offset, s.nbytes,
                         s.dtype, s.shape, self.version)

    # -- transitions -------------------------------------------------
    def _expect(self, *states: Residency) -> None:
        if self.state not in states:
            raise StateError(f"{self.key}: tensor is {self.state.name}, expected "
                             f"{' or '.join(s.name for s in states)}")

    def to_writing_back(self, transfer: "Transfer") -> None:
        self._expect(Residency.IN_POOL)
        self.transfer = transfer
        self.state = Residency.WRITING_BACK

    def to_reading_in(self, transfer: "Transfer") -> None:
        self._expect(Residency.ON_NVME)
        self.slot = transfer.slot
        self.transfer = transfer
        self.state = Residency.READING_IN

    def to_in_pool(self) -> None:
        self._expect(Residency.WRITING_BACK, Residency.READING_IN)
        self.transfer = None
        self.state = Residency.IN_POOL

    def to_on_nvme(self) -> None:
        """Its pool copy goes (evicted, or a swap-in failed): NVMe must hold it."""
        self._expect(Residency.IN_POOL, Residency.READING_IN)
        if self.disk is None or self.dirty:
            raise StateError(f"{self.key}: tensor has no clean NVMe copy; it cannot leave "
                             f"the pool")
        self.slot = None
        self.transfer = None
        self.state = Residency.ON_NVME


class Direction(enum.Enum):
    TO_NVME = "to_nvme"
    TO_POOL = "to_pool"


@dataclass(eq=False)
class Transfer:
    """One tensor moving between the pool and NVMe; the daemon runs the I/O."""

    direction: Direction
    entry: Entry
    slot: PoolSlot
    disk: DiskExtent
    drop_slot: bool = False   # a write-back that evicts: free the slot when done
    done: bool = False
    error: Exception | None = None

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes   # whole aligned data: what O_DIRECT moves after the header


@dataclass
class Blocked:
    """Retry the call once the transfers in ``wait`` are done."""

    wait: list[Transfer] = field(default_factory=list)


@dataclass(eq=False)
class Session:
    """One connected client process."""

    id: int
    job: str
    pid: int
    uid: int
    leases: dict[str, list[tuple[Entry, PoolSlot, bool]]] = field(default_factory=dict)
    reserved: dict[str, tuple[TensorSpec, PoolSlot]] = field(default_factory=dict)
    #: bytes of the job's tensors it keeps on its GPU between steps (as reported)
    gpu_resident_bytes: int = 0


@dataclass
class TierCounters:
    bytes_to_nvme: int = 0
    bytes_to_pool: int = 0
    bytes_read_ahead: int = 0   # of those, swap-ins begun by a job's access plan
    # how read-ahead passes ended ([Note: the job's access plan] in
    # tierd.server.readahead): at their horizon, or stopped with no tensor
    # used after the horizon to evict (no_room), or with room only once
    # transfers in flight land (waits: reads begun earlier, write-backs);
    # and the positions their horizons reached past now, summed
    read_ahead_passes: int = 0
    read_ahead_no_room: int = 0
    read_ahead_waits: int = 0
    read_ahead_reach: int = 0
    evictions: int = 0
    io_errors: int = 0


@dataclass(eq=False)
class Job:
    """A namespace of keys. A process's default job (``ephemeral``) ends with
    its last session; a named job lives until dropped."""

    name: str
    owner_uid: int
    ephemeral: bool
    sessions: set[int] = field(default_factory=set)
    pool_quota: int = 0      # bytes of pool it may use; 0: no quota
    nvme_quota: int = 0      # bytes of NVMe it may use; 0: no quota
    nvme_used: int = 0
    stored_bytes: int = 0    # as Catalog.stored_bytes, for this job
    largest: int = 0         # largest tensor it ever stored (its swap headroom)
    committed: list[DiskExtent] = field(default_factory=list)  # records of the last commit
    manifest: "Manifest | None" = None   # the last commit's manifest
    commit_written: int = 0  # bytes written back by the commit being made
    committing: bool = False  # a manifest of it is being written
    #: the session whose hello created it, until another joins or it stores a
    #: tensor: dropping such a job is dropping an unknown one (Catalog.drop_job)
    opened_by: int | None = None


ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8,
            "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
            "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1}


def stored_size(key: str, job: str, nbytes: int) -> int:
    """Bytes one tensor counts against pool + NVMe: its NVMe record (header
    block and aligned data), whichever tier holds it."""
    return RecordMeta(key, job, "uint8", (), nbytes, 0).record_len()


def spec_nbytes(spec: TensorSpec) -> int:
    n = ITEMSIZE[spec.dtype]
    for d in spec.shape:
        n *= d
    return n
