from __future__ import annotations

import pytest

from trainmesh.core.env import (
    DistEnv,
    LauncherEnvError,
    expand_slurm_nodelist,
    expand_slurm_tasks_per_node,
    launcher_rank,
)
from trainmesh.core.errors import UserError


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


def test_an_existing_group_gives_rank_and_world_size() -> None:
    """Ray Train's workers: torchrun's variables describe the group, and their node-local ranks are kept."""
    ray = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0"}
    env = DistEnv.from_process_group(5, 8, environ=ray)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.source) == (5, 1, 8, 4, "adopted")
    assert env.master_addr == "n0"
    # Variables that describe another group (or none) are not trusted: one node, unless told the local ranks.
    env = DistEnv.from_process_group(3, 4, environ=ray)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 3, 4, 4)
    env = DistEnv.from_process_group(3, 4, local_rank=1, local_world_size=2, environ={})
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (1, 2, 1, 2)
    with pytest.raises(ValueError, match="give both or neither"):
        DistEnv.from_process_group(0, 2, local_rank=0, environ={})
    with pytest.raises(ValueError, match="local rank 2 of 2"):
        DistEnv.from_process_group(0, 2, local_rank=2, local_world_size=2, environ={})


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


def test_slurm_nodelist_documented_forms() -> None:
    """The forms of SLURM's host lists (zero padding kept, several lists, several brackets, mixed ranges)."""
    assert expand_slurm_nodelist("node[001-003]") == ["node001", "node002", "node003"]
    assert expand_slurm_nodelist("a[1-2],b3") == ["a1", "a2", "b3"]
    assert expand_slurm_nodelist("rack[1-2]-node[01-02]") == [
        "rack1-node01",
        "rack1-node02",
        "rack2-node01",
        "rack2-node02",
    ]
    assert expand_slurm_nodelist("n[1,3-4]") == ["n1", "n3", "n4"]


def test_slurm_tasks_per_node_forms() -> None:
    assert expand_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_slurm_tasks_per_node("4") == [4]
    assert expand_slurm_tasks_per_node("1,2(x2)") == [1, 2, 2]
    assert expand_slurm_tasks_per_node("") == []
    with pytest.raises(LauncherEnvError, match=r"SLURM_TASKS_PER_NODE='2\(3\)' is not SLURM's form"):
        expand_slurm_tasks_per_node("2(3)")


def test_slurm_uneven_nodes_use_this_nodes_count() -> None:
    """7 tasks as 2(x3),1: the task on the 4th node (SLURM_NODEID=3) is alone there."""
    slurm = {"SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "n[1-4]"}
    last = DistEnv.from_environ({**slurm, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"})
    first = DistEnv.from_environ({**slurm, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"})
    assert (last.local_world_size, first.local_world_size) == (1, 2)
    assert last.master_addr == first.master_addr == "n1"


OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


@pytest.mark.parametrize(
    "variables",
    [
        OPEN_MPI,
        {  # MVAPICH2's mpirun_rsh and mpiexec
            "MV2_COMM_WORLD_RANK": "3",
            "MV2_COMM_WORLD_SIZE": "4",
            "MV2_COMM_WORLD_LOCAL_RANK": "1",
            "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        },
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},  # MPICH, Intel MPI
    ],
    ids=["openmpi", "mvapich2", "hydra"],
)
def test_mpi_launchers(variables: dict[str, str]) -> None:
    env = DistEnv.from_environ({**variables, "MASTER_ADDR": "n0", "MASTER_PORT": "4321"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.source) == ("n0", 4321, "mpi")
    assert env.export()["RANK"] == "3" and env.export()["LOCAL_WORLD_SIZE"] == "2"


def test_mpi_on_one_node_needs_no_master_address() -> None:
    one_node = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    env = DistEnv.from_environ(one_node)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)


@pytest.mark.parametrize(
    ("variables", "fix"),
    [
        (OPEN_MPI, "mpirun -x MASTER_ADDR=<host of rank 0> and mpirun -x MASTER_PORT=29500"),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
            "mpiexec -genv MASTER_ADDR <host of rank 0> and mpiexec -genv MASTER_PORT 29500",
        ),
    ],
)
def test_mpi_on_several_nodes_needs_the_master_address(variables: dict[str, str], fix: str) -> None:
    with pytest.raises(UserError, match="MASTER_ADDR is not set") as raised:
        DistEnv.from_environ(variables)
    assert fix in str(raised.value) and "2 of them on this node" in str(raised.value)


def test_precedence_torchrun_then_mpi_then_slurm() -> None:
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4"}
    # mpirun inside an sbatch script: every rank inherits the batch step's SLURM_PROCID=0; the MPI rank is right.
    env = DistEnv.from_environ({**slurm, **OPEN_MPI, "MASTER_ADDR": "n0"})
    assert (env.source, env.rank) == ("mpi", 3)
    # torchrun under mpirun: torchrun's processes are the ones that train.
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert DistEnv.from_environ({**slurm, **OPEN_MPI, **torchrun}).source == "torchrun"


def test_srun_with_pmi2_agrees_with_slurm() -> None:
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE (the same numbers as SLURM's) but not Hydra's local variables."""
    srun = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)"}
    both = DistEnv.from_environ({**srun, "PMI_RANK": "3", "PMI_SIZE": "4", "MASTER_ADDR": "n0"})
    alone = DistEnv.from_environ({**srun, "MASTER_ADDR": "n0"})
    assert (both.rank, both.local_rank, both.world_size, both.local_world_size) == (3, 1, 4, 2)
    assert (alone.rank, alone.local_rank, alone.world_size, alone.local_world_size) == (3, 1, 4, 2)


def test_mpi_without_local_variables_is_refused() -> None:
    with pytest.raises(UserError, match="PMI_RANK and PMI_SIZE are set but not MPI_LOCALRANKID/MPI_LOCALNRANKS"):
        DistEnv.from_environ({"PMI_RANK": "0", "PMI_SIZE": "2"})
    with pytest.raises(UserError, match="OMPI_COMM_WORLD_RANK=4 is outside 0..OMPI_COMM_WORLD_SIZE-1"):
        DistEnv.from_environ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "4"})


def test_kubeflow_pod_ranks_are_not_process_ranks() -> None:
    """A PyTorchJob pod: RANK is the pod's index, WORLD_SIZE = pods x nprocPerNode (training-operator's envvar.go)."""
    pod = {"RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    with pytest.raises(UserError, match=r"number the pods of a Kubeflow PyTorchJob.*trainmesh run <recipe>"):
        DistEnv.from_environ({**pod, "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1"})
    # One process per pod: the pod's index is the process's rank.
    one = DistEnv.from_environ({**pod, "WORLD_SIZE": "2", "PET_NPROC_PER_NODE": "1"})
    assert (one.rank, one.world_size, one.master_addr) == (1, 2, "job-master-0")
    # Under torchrun in that pod (LOCAL_RANK set), RANK is torchrun's.
    assert DistEnv.from_environ({**pod, "PET_NPROC_PER_NODE": "4", "LOCAL_RANK": "2"}).rank == 1


def test_launcher_rank_for_log_lines() -> None:
    assert launcher_rank({**OPEN_MPI, "MASTER_ADDR": "n0"}) == 3
    assert launcher_rank(OPEN_MPI) == 0  # no master address: DistEnv says so later; log as rank 0 meanwhile
    assert launcher_rank({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}) == 2
