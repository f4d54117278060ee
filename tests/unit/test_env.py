from __future__ import annotations

import pytest

from trainmesh.core.env import DistEnv, expand_slurm_nodelist


def test_single_process() -> None:
    env = DistEnv.from_environ({})
    assert (env.rank, env.world_size, env.source, env.is_distributed) == (0, 1, "single", False)


def test_torchrun_variables() -> None:
    env = DistEnv.from_environ(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "n0",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.node_rank, env.num_nodes) == (5, 1, 8, 1, 2)
    assert env.export()["MASTER_ADDR"] == "n0" and env.source == "torchrun"


def test_slurm_variables() -> None:
    env = DistEnv.from_environ(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.master_addr == "gpu07" and env.master_port == 20000 + 4242 and env.source == "slurm"


def test_torchrun_wins_over_slurm() -> None:
    env = DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert env.source == "torchrun"


def test_bad_values_are_named() -> None:
    with pytest.raises(RuntimeError, match="RANK=2 is outside"):
        DistEnv.from_environ({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="WORLD_SIZE='two' is not an integer"):
        DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "two"})


def test_slurm_nodelist_expansion() -> None:
    assert expand_slurm_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_slurm_nodelist("node5") == ["node5"]
    assert expand_slurm_nodelist("a[9-11]") == ["a9", "a10", "a11"]
    # Text after a bracket, and several brackets: these used to expand wrongly (a wrong master address).
    assert expand_slurm_nodelist("gpu-[1-2]-ib") == ["gpu-1-ib", "gpu-2-ib"]
    assert expand_slurm_nodelist("rack[1-2]-node[1-2]") == ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]
    assert expand_slurm_nodelist("b[2,1],a") == ["b2", "b1", "a"]  # SLURM's order, not sorted
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST='gpu\\[1-' is not a SLURM host list"):
        expand_slurm_nodelist("gpu[1-")
