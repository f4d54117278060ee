from __future__ import annotations

import os

import pytest
import torch

from trainmesh.launch import NO_SHARED_STORE, LaunchError, LaunchOptions, _agent_environment, torchrun_argv


def test_single_node_uses_loopback_and_a_free_port() -> None:
    argv = torchrun_argv(LaunchOptions(nproc_per_node="2"), ["trainmesh", "gpt"], module=True)
    assert "--nproc-per-node=2" in argv and "--master-addr=127.0.0.1" in argv
    port = int(next(a for a in argv if a.startswith("--master-port=")).split("=")[1])
    assert port > 0 and argv[-3:] == ["-m", "trainmesh", "gpt"]


def test_auto_is_one_process_per_gpu_else_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert LaunchOptions(nproc_per_node="auto").nproc() == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert LaunchOptions(nproc_per_node="auto").nproc() == 8


def test_static_multi_node() -> None:
    opts = LaunchOptions(nproc_per_node="4", nnodes="2", node_rank=1, master_addr="127.0.0.1", master_port=29400)
    argv = torchrun_argv(opts, ["train.py"], module=False)
    assert {"--nnodes=2", "--node-rank=1", "--master-port=29400"} <= set(argv) and argv[-1] == "train.py"
    assert opts.world_sizes() == [8]


def test_elastic_c10d() -> None:
    opts = LaunchOptions(nproc_per_node="2", nnodes="1:3", rdzv_endpoint="127.0.0.1:29411", rdzv_id="job7")
    argv = torchrun_argv(opts, ["x.py"], module=False)
    assert {
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29411",
        "--rdzv-id=job7",
        "--local-addr=127.0.0.1",
    } <= set(argv)
    assert opts.world_sizes() == [2, 4, 6] and opts.default_run_suffix() == "job7"
    assert "--rdzv-conf=join_timeout=300" in argv


def test_rdzv_conf_is_added_to_the_join_timeout() -> None:
    opts = LaunchOptions(
        nnodes="1:2", rdzv_endpoint="127.0.0.1:29411", rdzv_conf="last_call_timeout=5, keep_alive_interval=2"
    )
    argv = torchrun_argv(opts, ["x.py"], module=False)
    assert "--rdzv-conf=join_timeout=300,last_call_timeout=5,keep_alive_interval=2" in argv


def test_c10d_agents_do_not_share_their_store_with_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared, a node joining a later round waits forever for MASTER_ADDR (launch.NO_SHARED_STORE)."""
    monkeypatch.delenv(NO_SHARED_STORE, raising=False)
    with _agent_environment(LaunchOptions(nnodes="1:2", rdzv_endpoint="127.0.0.1:29411")):
        assert os.environ[NO_SHARED_STORE] == "1"
    assert NO_SHARED_STORE not in os.environ
    with _agent_environment(LaunchOptions(nproc_per_node="2")):  # one node: the agent's store, shared
        assert NO_SHARED_STORE not in os.environ
    monkeypatch.setenv(NO_SHARED_STORE, "0")  # the user's choice wins
    with _agent_environment(LaunchOptions(nnodes="1:2", rdzv_endpoint="127.0.0.1:29411")):
        assert os.environ[NO_SHARED_STORE] == "0"


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (LaunchOptions(nproc_per_node="many"), "--nproc-per-node='many'"),
        (LaunchOptions(nnodes="3:1"), "1 <= MIN <= MAX"),
        (LaunchOptions(nnodes="2"), "needs --master-addr and --master-port"),
        (LaunchOptions(nnodes="1:2", master_addr="a", master_port=1), "needs --rdzv-endpoint"),
        (LaunchOptions(rdzv_endpoint="nohostport"), "expected HOST:PORT"),
        (LaunchOptions(nnodes="2", rdzv_endpoint="127.0.0.1:1", rdzv_conf="last_call_timeout"), "KEY=VALUE"),
        (LaunchOptions(nnodes="2", rdzv_endpoint="127.0.0.1:1", rdzv_conf="join_timeout=9"), "--join-timeout"),
        (LaunchOptions(rdzv_conf="last_call_timeout=5"), "needs --rdzv-endpoint"),
        (LaunchOptions(nnodes="2", master_addr="no-such-host.invalid", master_port=1), "does not resolve"),
    ],
)
def test_bad_launch_options_name_the_flag(opts: LaunchOptions, message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("[", r"\[")):
        torchrun_argv(opts, ["x.py"], module=False)


def test_c10d_without_an_id_derives_one_from_the_endpoint() -> None:
    opts = LaunchOptions(nnodes="2", rdzv_endpoint="10.0.0.1:29400")
    assert opts.rendezvous_id() == "tm-10-0-0-1-29400" == opts.default_run_suffix()
    assert "--rdzv-id=tm-10-0-0-1-29400" in torchrun_argv(opts, ["x.py"], module=False)
