"""A cluster described in JSON (`trainmesh plan --cluster F.json`, and `--cluster this`'s calibration): every
field's type and range checked, and a bad file refused in one line that names the file and the key."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from support import nano_toml
from trainmesh.apps.plan import cluster as cluster_module
from trainmesh.apps.plan.cluster import PRESETS, Cost, get_cluster, load_calibration, save_calibration
from trainmesh.cli import main
from trainmesh.cli import plan as command_module
from trainmesh.cli.plan import read_cluster_file
from trainmesh.config import ConfigError

pytestmark = pytest.mark.timeout(60)


def _h100(tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "h100.json"
    save_calibration(PRESETS["h100"], path)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


class _Delete:
    def __repr__(self) -> str:
        return "DELETE"  # a stable test id


DELETE = _Delete()  # the key is removed instead


def _set(data: dict[str, Any], key: str, value: object) -> dict[str, Any]:
    """`data` with the value at dotted `key` replaced (or removed, for the DELETE marker)."""
    *parents, last = key.split(".")
    inner = data
    for part in parents:
        inner = inner[part]
    if value is DELETE:
        del inner[last]
    else:
        inner[last] = value
    return data


# (dotted key, value written there, what the message must say)
BAD = [
    ("intra.costs.all_reduce.latency", -1.0, "intra.costs.all_reduce.latency=-1.0 must be seconds >= 0"),
    ("inter.costs.p2p.latency", math.nan, "inter.costs.p2p.latency=NaN must be seconds >= 0"),
    ("host.latency", -1e-5, "host.latency=-1e-05 must be seconds >= 0"),
    ("overhead", -5e9, "overhead=-5000000000.0 must be bytes >= 0"),
    ("step_overhead", -0.5, "step_overhead=-0.5 must be seconds >= 0"),
    ("fsdp_unit_overhead", -1, "fsdp_unit_overhead=-1 must be seconds >= 0"),
    ("devices_per_node", True, "devices_per_node=true must be a whole number from 1 to 1,000,000"),
    ("devices_per_node", 8.0, "devices_per_node=8.0 must be a whole number"),
    ("nodes", 0, "nodes=0 must be a whole number from 1"),
    ("memory", "80GB", 'memory="80GB" must be bytes > 0'),
    ("memory", math.inf, "memory=Infinity must be bytes > 0"),
    ("memory", 10**400, "memory=1000000000000000000000000000000000000... must be bytes > 0"),
    ("memory", False, "memory=false must be bytes > 0"),
    ("efficiency", 0, "efficiency=0 must be a number above 0, at most 1"),
    ("efficiency", 1.5, "efficiency=1.5 must be a number above 0, at most 1"),
    ("overlap", -0.1, "overlap=-0.1 must be a number from 0 to 1"),
    ("forward_share", 2, "forward_share=2 must be a number from 0 to 1"),
    ("tp_unsplit", None, "tp_unsplit=null must be a number from 0 to 1"),
    ("memory_margin", 1, "memory_margin=1 must be a number from 0 to below 1"),
    ("memory_margin", -0.1, "memory_margin=-0.1 must be a number from 0 to below 1"),
    ("busy_slowdown", 0.5, "busy_slowdown=0.5 must be a factor >= 1"),
    ("mem_bandwidth", 0, "mem_bandwidth=0 must be bytes/s > 0"),
    ("host_bandwidth", -1, "host_bandwidth=-1 must be bytes/s > 0"),
    ("intra.costs.all_gather.bandwidth", -45e9, "intra.costs.all_gather.bandwidth=-45000000000.0 must be bytes/s > 0"),
    ("peak_flops.bf16", 0.5, "peak_flops.bf16=0.5 must be FLOP/s >= 1"),
    ("peak_flops.fp32", DELETE, "peak_flops.fp32 is missing"),
    ("peak_flops.fp8", 1e15, '"peak_flops.fp8" is not a key trainmesh reads (keys here: bf16, tf32, fp32)'),
    ("overlpa", 0.5, '"overlpa" is not a key trainmesh reads'),
    ("a\nb", 0.5, '"a\\nb" is not a key trainmesh reads'),
    ("intra.costs.reduce_scatter", DELETE, "intra.costs.reduce_scatter is missing"),
    ("intra", [], "intra must be a JSON object, not []"),
    ("host", {"bandwidth": 1e9}, "host.latency is missing (seconds >= 0)"),
    ("device", "tpu", "device=\"tpu\" must be 'cuda' or 'cpu'"),
    ("name", 3, "name=3 must be a string"),
    ("notes", [1], "notes=[1] must be a list of strings"),
    ("memory", DELETE, "memory is missing (bytes > 0)"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_file_and_the_key(
    tmp_path: Path, key: str, value: object, message: str
) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_set(_h100(tmp_path), key, value)))
    with pytest.raises(ValueError) as refused:
        get_cluster(str(path), nodes=1, devices_per_node=None)
    text = str(refused.value)
    assert message in text and str(path) in text and "\n" not in text, text
    # the file may describe another cluster, by hand: measuring this machine over it is only the second way out
    assert f"Fix: correct it in {path}, or, if the file is to describe this machine, measure it afresh" in text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[" * 100_000, "its JSON nests too deeply"),  # a RecursionError in json's parser, not a traceback
        ('{"name": ' + "[" * 100_000, "its JSON nests too deeply"),
        ("[]", "the file must be a JSON object, not []"),
        ("{not json", "Expecting property name"),
        (b"\xff\xfe{}", "can't decode byte 0xff"),
    ],
    ids=["deep", "deep-inside", "list", "not-json", "not-utf8"],
)
def test_a_file_that_is_no_json_object_is_refused_in_one_line(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    path = tmp_path / "cluster.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as refused:
        load_calibration(path)
    text = str(refused.value)
    assert message in text and f"{path} is not a calibration trainmesh can read" in text and "\n" not in text, text


def test_what_trainmesh_writes_reads_back_and_defaults_may_be_left_out(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    for preset in PRESETS.values():
        save_calibration(preset, path)
        assert load_calibration(path) == preset
    # a CPU calibration's host copies cost nothing: Infinity is written, and read back
    cpu = dataclasses.replace(PRESETS["a100"], device="cpu", host=Cost(math.inf, 0.0), notes=("measured",))
    save_calibration(cpu, path)
    assert "Infinity" in path.read_text() and load_calibration(path) == cpu
    data = _h100(tmp_path)
    for key in ("step_overhead", "forward_share", "busy_slowdown", "fsdp_unit_overhead", "tp_unsplit", "notes"):
        del data[key]
    path.write_text(json.dumps(data))
    assert load_calibration(path) == PRESETS["h100"]


def test_a_cluster_file_counts_toward_the_rank_limit(tmp_path: Path) -> None:
    """The flags' own check assumes 8 devices a node; a file's devices_per_node is only known once read."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**_h100(tmp_path), "devices_per_node": 1_000_000}))
    assert get_cluster(str(path), nodes=1, devices_per_node=None).world_size == 1_000_000
    with pytest.raises(ValueError, match=r"--nodes=2 × 1000000 devices per node = 2,000,000 ranks: plan up to"):
        get_cluster(str(path), nodes=2, devices_per_node=None)


def test_a_broken_cluster_file_can_be_calibrated_afresh_in_its_place(tmp_path: Path) -> None:
    """Refused before anything is measured, unless --calibrate is about to write that very file."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_set(_h100(tmp_path), "nodes", 0)))

    def flags(calibrate: bool) -> argparse.Namespace:
        return argparse.Namespace(cluster=str(path), calibrate=calibrate)

    assert read_cluster_file(flags(calibrate=True), tmp_path / "." / "cluster.json") is None  # the same file
    for calibrate, calibration in ((True, tmp_path / "other.json"), (False, path)):
        with pytest.raises(ConfigError, match="nodes=0 must be a whole number"):
            read_cluster_file(flags(calibrate), calibration)
    save_calibration(PRESETS["a100"], path)
    assert read_cluster_file(flags(calibrate=False), path) == PRESETS["a100"]


def test_plan_reads_a_cluster_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cluster.json"
    save_calibration(PRESETS["h100"], path)
    read: list[Path] = []

    def counted(file: Path) -> Any:
        read.append(file)
        return load_calibration(file)

    for module in (cluster_module, command_module):
        monkeypatch.setattr(module, "load_calibration", counted)
    code = main(["plan", "gpt", "--config", str(nano_toml(tmp_path)), "--cluster", str(path), "--nodes", "1"])
    assert code == 0, capsys.readouterr().err
    assert read == [path]
