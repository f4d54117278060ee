"""The machines a plan is made for: built-in presets (A100, H100, H200 nodes) and this machine, calibrated. A `Cluster`
holds each device's memory, FLOP/s and bandwidth and each link's cost; calibrations are JSON files.

Details: docs/internals.md#appsplanclusterpy
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from trainmesh.core.env import cache_home
from trainmesh.core.files import write_atomically

GB, GiB = 1e9, 2**30
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
PEAK_DTYPES = ("bf16", "tf32", "fp32")
MiB = 2**20
MAX_RANKS = 1_000_000
# Kept free on each device for what the memory model does not count (fragmentation, NCCL's buffers; not measured
# here). 10%: the bar PyTorch holds its own memory trackers to against the measured peak (test_fsdp2_mem_tracker.py).
MEMORY_MARGIN = 0.10


def size_unit(largest: float) -> tuple[str, float]:
    """GiB, or MiB when `largest` (bytes) is under a GiB: the unit a table of such sizes reads best in."""
    return ("GiB", GiB) if largest >= GiB else ("MiB", MiB)


@dataclass(frozen=True)
class Cost:
    """Time of one collective step: `latency` seconds per hop + bytes moved / `bandwidth` (bytes/s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Link:
    """The cost of each collective on one kind of link (all alike for a preset; measured apart by calibration)."""

    costs: dict[str, Cost]

    @classmethod
    def uniform(cls, bandwidth: float, latency: float) -> Link:
        return cls({kind: Cost(bandwidth, latency) for kind in COLLECTIVES})

    def time(self, kind: str, nbytes: float, ranks: int, messages: int = 1) -> float:
        """Seconds for `kind` over `ranks` ranks; `nbytes` is the full (unsharded) buffer, sent as `messages`
        collectives (FSDP: one per unit; DDP: one per bucket), each paying the latency. Ring bandwidth terms
        (all-reduce moves 2(n−1)/n of the buffer per rank, all-gather and reduce-scatter (n−1)/n, p2p all of
        it). Latency: log2 n steps for an all-reduce (NCCL's tree and NVLS algorithms at scale), n − 1 for an
        all-gather or reduce-scatter (NCCL runs them as rings; its logarithmic PAT algorithm covers one GPU per
        node only, NVIDIA/nccl#1473)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        cost = self.costs[kind]
        share = {"all_reduce": 2 * (ranks - 1) / ranks, "p2p": 1.0}.get(kind, (ranks - 1) / ranks)
        hops = {"p2p": 1, "all_reduce": max(1, (ranks - 1).bit_length())}.get(kind, ranks - 1)
        latency = (2 if kind == "all_reduce" else 1) * hops * cost.latency
        return share * nbytes / cost.bandwidth + messages * latency


@dataclass(frozen=True)
class Cluster:
    name: str
    device: str
    """'cuda' or 'cpu'."""
    memory: float
    """Bytes per device (per process on a CPU: the node's memory over its processes)."""
    devices_per_node: int
    nodes: int
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per compute dtype: 'bf16' (also fp16), 'tf32', 'fp32'."""
    efficiency: float
    """Fraction of the peak the model's step achieves (an assumption until calibrated)."""
    mem_bandwidth: float
    """Bytes/s the optimizer step streams through (device memory; host memory with CPU offload)."""
    intra: Link
    inter: Link
    host: Cost
    """Host↔device copies (CPU offload); a CPU has none to make."""
    host_bandwidth: float
    """Bytes/s the optimizer streams through host memory when it steps on the CPU (CPU offload)."""
    overhead: float
    """Bytes every process holds before the model (CUDA context, NCCL and cuBLAS workspaces)."""
    overlap: float
    """Fraction of the compute that communication may hide behind (0: none, as on CPU cores that do both)."""
    step_overhead: float = 0.0
    """Seconds of a whole model's forward + backward that do not grow with its tokens (kernel launches, Python):
    calibrated; 0 in the presets, whose efficiency stands for it."""
    forward_share: float = 1 / 3
    """The forward's share of a forward + backward's time: its share of the FLOPs (1/3) unless calibrated."""
    busy_slowdown: float = 1.0
    """How much longer a device computes while every device of its node computes too: CPU cores share memory
    bandwidth and caches (calibrated); 1 for GPUs."""
    fsdp_unit_overhead: float = 0.0
    """Seconds FSDP spends per unit per micro-step besides communicating (hooks, bookkeeping): calibrated where two
    processes can run; 0 in the presets."""
    tp_unsplit: float = 0.0
    """The share of a step's per-token work that tensor parallelism does not divide (replicated LayerNorms and
    loss, DTensor's dispatch): calibrated where two processes can run; 0 in the presets (Megatron's assumption)."""
    efficiency_range: tuple[float, ...] = ()
    """The fractions of peak that published training of GPT-class models reaches on this device, lowest and highest
    (a preset's; empty once calibrated): the span an assumed efficiency's times and MFU may be off by."""
    memory_margin: float = MEMORY_MARGIN
    """Fraction of each device's memory left for what the model does not count (allocator fragmentation, NCCL's
    buffers as they grow): a layout fits within the rest."""
    calibrated: str = ""
    """Where the figures were measured (a calibration file), or '' for a preset's assumptions."""
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int, devices_per_node: int | None = None) -> Cluster:
        return replace(self, nodes=nodes, devices_per_node=devices_per_node or self.devices_per_node)

    @property
    def time_error(self) -> float:
        """The relative error of a predicted step time: 15%, within which the calibrated model predicted every
        validated layout (docs/plan.md, "How good is it"); a preset's datasheet figures are not validated here, so
        their error is at least that (the header gives their efficiency span)."""
        return 0.15

    @property
    def usable_memory(self) -> float:
        """Bytes a layout may use on each device: its memory less the margin."""
        return self.memory * (1 - self.memory_margin)

    def flops(self, compute_dtype: str) -> float:
        """Achievable FLOP/s for `compute_dtype` ('bf16', 'tf32', 'fp32')."""
        return self.peak_flops[compute_dtype] * self.efficiency

    def link(self, group_size: int, stride: int) -> Link:
        """The link a group of `group_size` ranks `stride` apart in the rank order crosses: inside one node when
        the group's span fits in a node and lines up with node boundaries; else between nodes, where a
        collective's rings use the NICs of all the group's ranks on a node (one NIC per GPU, rail-optimised, as
        NCCL does): k × a NIC's bandwidth for k ranks on every node, up to the bandwidth inside the node (a
        point-to-point send uses one NIC; a group unevenly spread over nodes is as fast as its thinnest node)."""
        span = group_size * stride
        if span <= self.devices_per_node and self.devices_per_node % span == 0:
            return self.intra
        aligned = span % self.devices_per_node == 0 and self.devices_per_node % stride == 0
        nics = max(1, min(group_size, self.devices_per_node // stride)) if aligned else 1

        def across(kind: str, cost: Cost) -> Cost:
            if kind == "p2p":
                return cost
            return Cost(min(nics * cost.bandwidth, self.intra.costs[kind].bandwidth), cost.latency)

        return Link({kind: across(kind, cost) for kind, cost in self.inter.costs.items()})


def _gpu(
    name: str,
    memory: float,
    bf16: float,
    tf32: float,
    fp32: float,
    hbm: float,
    nvlink: float,
    ib: float,
    efficiency_range: tuple[float, float],
) -> Cluster:
    return Cluster(
        name=name,
        device="cuda",
        memory=memory,
        devices_per_node=8,
        nodes=1,
        peak_flops={"bf16": bf16, "tf32": tf32, "fp32": fp32},
        efficiency=0.45,
        mem_bandwidth=hbm,
        intra=Link.uniform(nvlink, 8e-6),
        inter=Link.uniform(ib, 15e-6),
        host=Cost(25 * GB, 10e-6),  # PCIe gen4/5 x16 as achieved by pinned copies
        host_bandwidth=100 * GB,  # a two-socket server's DDR, as a CPU AdamW streams it
        overhead=1.0 * GiB,
        overlap=0.9,
        efficiency_range=efficiency_range,
    )


# Dense peaks (NVIDIA datasheets, SXM parts); NVLink as the all-reduce bus bandwidth nccl-tests reach on a DGX;
# InfiniBand one 200 (A100) or 400 Gb/s (H100, H200) NIC per GPU.
PRESETS: dict[str, Cluster] = {
    # MFU of GPT-class training in practice: A100 31% (PyTorch GPT-2, llm.c PR #323) to 60% (llm.c, 8 GPUs);
    # H100 and H200 33% (nanoGPT on one H100, PR #464; this project measured 35%) to 47% (Megatron-Core's README)
    "a100": _gpu("a100", 80 * GiB, 312e12, 156e12, 19.5e12, 2.04e12, 230 * GB, 23 * GB, (0.31, 0.60)),
    "h100": _gpu("h100", 80 * GiB, 989e12, 494e12, 67e12, 3.35e12, 450 * GB, 45 * GB, (0.33, 0.47)),
    "h200": _gpu("h200", 141 * GB, 989e12, 494e12, 67e12, 4.8e12, 450 * GB, 45 * GB, (0.33, 0.47)),
}
CLUSTERS = (*PRESETS, "this")


def calibration_path() -> Path:
    """Where `plan --calibrate` saves this machine's figures unless --calibration names a file."""
    base = str(cache_home())
    return Path(base) / "trainmesh" / "plan-calibration.json"


def save_calibration(cluster: Cluster, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(asdict(cluster), indent=2) + "\n")


def load_calibration(path: Path) -> Cluster:
    """The cluster a calibration file describes (ValueError saying how to make one when it is missing or bad)."""
    if not path.is_file():
        raise ValueError(
            f"--cluster this needs a calibration of this machine, and {path} does not exist. "
            "Fix: run `trainmesh plan --calibrate` first (or name a preset: --cluster h100)."
        )
    # Not just "calibrate afresh": the file may describe another cluster, by hand, that this machine cannot measure
    fix = (
        f"Fix: correct it in {path}, or, if the file is to describe this machine, measure it afresh (replacing the "
        f"file): `trainmesh plan --calibrate --calibration {path}`."
    )
    try:
        data = json.loads(path.read_text())
    except RecursionError:  # json's parser recurses once per '[' or '{'
        raise ValueError(f"{path} is not a calibration trainmesh can read: its JSON nests too deeply. {fix}") from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ValueError(f"{path} is not a calibration trainmesh can read: {e}. {fix}") from None
    try:
        return cluster_from_json(data)
    except ValueError as e:
        raise ValueError(f"{path} is not a calibration trainmesh can read: {e}. {fix}") from None


@dataclass(frozen=True)
class _Rule:
    """What one value of a cluster file may be: `allowed` in words; `read` gives the value the Cluster takes, or
    None when the JSON value is not allowed."""

    allowed: str
    read: Callable[[object], object]


def _number(allowed: str, ok: Callable[[float], bool]) -> _Rule:
    """A JSON number (never a boolean, which Python counts as an int) for which `ok` holds, as a float."""

    def read(value: object) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        try:
            number = float(value)
        except OverflowError:  # a JSON integer beyond any float
            return None
        return number if ok(number) else None

    return _Rule(allowed, read)


def _finite(low: float, high: float = math.inf, *, above_low: bool = False) -> Callable[[float], bool]:
    return lambda x: math.isfinite(x) and (x > low if above_low else x >= low) and x <= high


_BANDWIDTH = _number("bytes/s > 0 (Infinity: costs nothing)", lambda x: x > 0)  # NaN fails every comparison
_LATENCY = _number("seconds >= 0", _finite(0))
_FRACTION = _number("a number from 0 to 1", _finite(0, 1))
_COST = {"bandwidth": _BANDWIDTH, "latency": _LATENCY}
_LINK = {"costs": dict.fromkeys(COLLECTIVES, _COST)}
_RANKS = _Rule(
    f"a whole number from 1 to {MAX_RANKS:,}",
    lambda x: x if type(x) is int and 1 <= x <= MAX_RANKS else None,  # type(): a boolean is no count
)


def _fraction_pair(x: object) -> bool:
    return (
        isinstance(x, list)
        and len(x) == 2
        and all(type(v) in (int, float) and math.isfinite(v) and 0 < v <= 1 for v in x)
        and x[0] <= x[1]
    )


_TEXT = _Rule("a string", lambda x: x if isinstance(x, str) else None)
# The JSON keys of a cluster file (asdict(Cluster)) and what each may be; a dict is a JSON object of its own.
_SCHEMA: dict[str, Any] = {
    "name": _TEXT,
    "device": _Rule("'cuda' or 'cpu'", lambda x: x if x in ("cuda", "cpu") else None),
    "memory": _number("bytes > 0", _finite(0, above_low=True)),
    "devices_per_node": _RANKS,
    "nodes": _RANKS,
    "peak_flops": dict.fromkeys(PEAK_DTYPES, _number("FLOP/s >= 1", _finite(1))),
    "efficiency": _number("a number above 0, at most 1", _finite(0, 1, above_low=True)),
    "mem_bandwidth": _BANDWIDTH,
    "intra": _LINK,
    "inter": _LINK,
    "host": _COST,
    "host_bandwidth": _BANDWIDTH,
    "overhead": _number("bytes >= 0", _finite(0)),
    "overlap": _FRACTION,
    "step_overhead": _LATENCY,
    "forward_share": _FRACTION,
    "busy_slowdown": _number("a factor >= 1", _finite(1)),
    "fsdp_unit_overhead": _LATENCY,
    "tp_unsplit": _FRACTION,
    "efficiency_range": _Rule(
        "[] or [lowest, highest], fractions of peak above 0, at most 1",
        lambda x: tuple(float(v) for v in x) if isinstance(x, list) and (x == [] or _fraction_pair(x)) else None,
    ),
    "memory_margin": _number("a number from 0 to below 1", lambda x: math.isfinite(x) and 0 <= x < 1),
    "calibrated": _TEXT,
    "notes": _Rule(
        "a list of strings", lambda x: tuple(x) if isinstance(x, list) and all(isinstance(n, str) for n in x) else None
    ),
}


def cluster_from_json(data: object) -> Cluster:
    """The Cluster a cluster file's JSON describes: every key known, every value of its type and in its range
    (ValueError naming the first key that is not, with what it may be). The keys with a default in Cluster may
    be left out."""
    optional = {f.name for f in fields(Cluster) if f.default is not MISSING}
    values = _read_object(data, _SCHEMA, "", optional)
    links = {
        key: Link({kind: Cost(**cost) for kind, cost in values[key]["costs"].items()}) for key in ("intra", "inter")
    }
    return Cluster(**{**values, **links, "host": Cost(**values["host"])})


def _read_object(data: object, schema: dict[str, Any], where: str, optional: set[str]) -> dict[str, Any]:
    """The values of a JSON object `data` read by `schema` (`where`: its key path, for messages)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where.rstrip('.') or 'the file'} must be a JSON object, not {_shown(data)}")
    unknown = sorted(set(data) - set(schema))
    if unknown:
        key = _shown(where + unknown[0])  # quoted: a key may hold any character, a newline too
        raise ValueError(f"{key} is not a key trainmesh reads (keys here: {', '.join(schema)})")
    values: dict[str, Any] = {}
    for key, rule in schema.items():
        name = where + key
        if key not in data:
            if key in optional:
                continue
            raise ValueError(f"{name} is missing ({_allowed(rule)})")
        if isinstance(rule, dict):
            values[key] = _read_object(data[key], rule, name + ".", set())
            continue
        value = rule.read(data[key])
        if value is None:
            raise ValueError(f"{name}={_shown(data[key])} must be {rule.allowed}")
        values[key] = value
    return values


def _allowed(rule: _Rule | dict[str, Any]) -> str:
    return f"an object with keys {', '.join(rule)}" if isinstance(rule, dict) else rule.allowed


def _shown(value: object, limit: int = 40) -> str:
    """`value` as JSON spells it (`true`, not True), cut short: the message stays one line whatever the file holds."""
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError):
        return "a deeply nested value"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cluster_problem(name: str) -> str | None:
    """Why --cluster=`name` names no cluster, or None."""
    if name in CLUSTERS:
        return None
    if not name.endswith(".json"):
        return f"--cluster={name!r} is not one of {', '.join(CLUSTERS)}, nor a .json file describing one"
    if not Path(name).is_file():
        return f"--cluster={name!r}: no such file. Fix: a preset ({', '.join(CLUSTERS)}) or a JSON file"
    return None


def get_cluster(name: str, nodes: int, devices_per_node: int | None, calibration: Path | None = None) -> Cluster:
    """The cluster --cluster=`name` names (`read_cluster`), for `nodes` nodes (`for_nodes`)."""
    return for_nodes(read_cluster(name, calibration), nodes, devices_per_node)


def read_cluster(name: str, calibration: Path | None = None) -> Cluster:
    """A preset (`a100`, `h100`, `h200`), `this` (the saved calibration) or a cluster described in a JSON file
    (a calibration's format: `trainmesh plan --calibrate --calibration F.json` writes one to start from)."""
    if name == "this":
        return load_calibration(calibration or calibration_path())
    if name in PRESETS:
        return PRESETS[name]
    problem = cluster_problem(name)
    if problem:
        raise ValueError(problem)
    return load_calibration(Path(name))


def for_nodes(cluster: Cluster, nodes: int, devices_per_node: int | None) -> Cluster:
    """`cluster` with `nodes` nodes (and `devices_per_node` devices each, if given), within the rank limit."""
    if nodes < 1 or (devices_per_node is not None and devices_per_node < 1):
        raise ValueError(f"--nodes={nodes} and --devices-per-node={devices_per_node} must be at least 1")
    sized = cluster.with_nodes(nodes, devices_per_node)
    if sized.world_size > MAX_RANKS:  # a cluster file's devices_per_node is only known here
        raise ValueError(
            f"--nodes={nodes} × {sized.devices_per_node} devices per node = {sized.world_size:,} ranks: plan up to "
            f"{MAX_RANKS:,}. Fix: fewer --nodes or --devices-per-node."
        )
    return sized
