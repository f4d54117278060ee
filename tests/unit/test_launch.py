from __future__ import annotations

import dataclasses
import datetime
import os
import random
import re
import signal
import socket
import time
import types
from pathlib import Path

import pytest
import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import Std

from trainmesh.cli.flags import build_parser, split_recipe_args
from trainmesh.core.env import _ephemeral_ports, free_port
from trainmesh.job.launcher import launch_options
from trainmesh.launch import (
    NO_SHARED_STORE,
    LaunchError,
    LaunchOptions,
    _agent_environment,
    exit_records,
    torchrun_argv,
)
from trainmesh.launch.exit_records import ExitRecord, read_records, record_exit, record_start, records_folder
from trainmesh.launch.outcome import explain_stop
from trainmesh.launch.rank_logs import NO_LOG_DIR, LogSettings, RankLogs, claim_launch_folder, tail


def test_single_node_uses_loopback_and_a_free_port() -> None:
    argv = torchrun_argv(LaunchOptions(nproc_per_node="2"), ["trainmesh", "gpt"], module=True)
    assert "--nproc-per-node=2" in argv and "--master-addr=127.0.0.1" in argv
    port = int(next(a for a in argv if a.startswith("--master-port=")).split("=")[1])
    assert port > 0 and argv[-3:] == ["-m", "trainmesh", "gpt"]


def test_free_ports_are_drawn_below_the_ephemeral_range_whatever_the_seed() -> None:
    """Outgoing connections and bind(0) take ports of the ephemeral range: a server port drawn there could be taken
    between free_port() and the server's bind (a hung rendezvous, seen once in the suite). Seeded runs draw apart."""
    low, state = _ephemeral_ports()[0], random.getstate()
    drawn = []
    for _ in range(2):
        random.seed(0)
        drawn.append([free_port() for _ in range(3)])
    random.setstate(state)  # the worker's other tests keep their own draws
    assert all(1024 <= port < low for port in drawn[0] + drawn[1]) and drawn[0] != drawn[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", drawn[0][0]))  # free


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


# --- per-rank logs (launch/rank_logs.py) -------------------------------------------------------------------------


def test_logs_are_kept_with_local_rank_0_on_the_console_unless_told_otherwise(tmp_path: Path) -> None:
    assert LogSettings().torchrun_flags() == ("0", "3", "0")  # a recipe's run: <run>/logs, both streams, rank 0
    assert LogSettings(NO_LOG_DIR).torchrun_flags() == ("0", "0", "")  # torchrun's: every rank on the console
    assert LogSettings("x", tee="2", local_ranks_filter="").torchrun_flags() == ("0", "2", "")
    opts = LaunchOptions(nproc_per_node="2", logs=LogSettings(str(tmp_path)))
    argv = torchrun_argv(opts, ["x.py"], module=False, log_folder=tmp_path / "launch")
    assert {f"--log-dir={tmp_path / 'launch'}", "--tee=3", "--local-ranks-filter=0"} <= set(argv)
    plain = torchrun_argv(LaunchOptions(nproc_per_node="2", logs=LogSettings(NO_LOG_DIR)), ["x.py"], module=False)
    assert not [a for a in plain if a.startswith(("--log-dir", "--tee", "--redirects", "--local-ranks-filter"))]


@pytest.mark.parametrize(
    ("logs", "message"),
    [
        (LogSettings(tee="4"), "--tee='4': expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (LogSettings(redirects="0:x"), "--redirects='0:x'"),
        (LogSettings(local_ranks_filter="first"), "--local-ranks-filter='first': expected local ranks"),
        (LogSettings(NO_LOG_DIR, local_ranks_filter="0"), "hides local rank(s) [1] from the console, and they have no"),
        (LogSettings(tee="0:3,1:2"), "hides local rank(s) [1] from the console, and they have no file for both"),
    ],
)
def test_log_settings_that_would_lose_output_or_do_not_parse_are_refused(logs: LogSettings, message: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(message)):
        LaunchOptions(nproc_per_node="2", logs=logs).check()


def test_each_rank_writes_into_its_own_folder_named_by_attempt_and_global_rank(tmp_path: Path) -> None:
    """What torchrun's agent asks of the LogsSpecs at each (re)start: here node 2 of a job (global ranks 4, 5),
    after one restart, showing local rank 0 on the console."""
    envs = {lr: {"RANK": str(4 + lr), "TORCHELASTIC_RESTART_COUNT": "1"} for lr in (0, 1)}
    dest = RankLogs(tmp_path, Std.ALL, Std.ALL, {0}).reify(envs)
    folders = [tmp_path / "attempt_1" / f"rank_{r}" for r in (4, 5)]
    assert dest.stdouts == {0: str(folders[0] / "stdout.log"), 1: str(folders[1] / "stdout.log")}
    assert dest.stderrs == {0: str(folders[0] / "stderr.log"), 1: str(folders[1] / "stderr.log")}
    assert dest.tee_stdouts == {0: dest.stdouts[0]} and dest.tee_stderrs == {0: dest.stderrs[0]}  # rank 1: file only
    assert [envs[lr]["TORCHELASTIC_ERROR_FILE"] for lr in (0, 1)] == [str(f / "error.json") for f in folders]
    assert all(f.is_dir() for f in folders)
    # Streams neither kept nor shown are dropped, shown ones go to the console ("" in torch's spelling).
    (tmp_path / "b").mkdir()  # a launch's folder (claim_launch_folder)
    dest = RankLogs(tmp_path / "b", Std.NONE, Std.ERR, {0}).reify(envs)
    assert dest.stdouts == {0: "", 1: os.devnull} and dest.tee_stderrs == {0: dest.stderrs[0]}


def test_a_restart_without_a_new_attempt_number_gets_a_folder_of_its_own(tmp_path: Path) -> None:
    """Nodes joining or leaving restart the workers without counting a restart; torch opens their log files for
    writing, so the same folder would lose the earlier round's output."""
    envs = {0: {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}}
    logs = RankLogs(tmp_path, Std.ALL, Std.ALL, {0})
    first = Path(logs.reify(envs).stderrs[0])
    first.write_text("round 1\n")
    second = Path(logs.reify({0: {"RANK": "3", "TORCHELASTIC_RESTART_COUNT": "0"}}).stderrs[0])
    assert second == tmp_path / "attempt_0-2" / "rank_3" / "stderr.log" and first.read_text() == "round 1\n"
    assert Path(logs.reify(envs).stderrs[0]).parent.parent.name == "attempt_0-3"
    assert Path(logs.reify({0: {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}}).stderrs[0]).parent.parent.name == (
        "attempt_1"
    )


def test_launches_in_the_same_second_get_their_own_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainmesh.launch import rank_logs

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> Clock:
            return cls(2026, 11, 24, 1, 2, 3)

    monkeypatch.setattr(rank_logs, "dt", types.SimpleNamespace(datetime=Clock))
    names = [claim_launch_folder(tmp_path, False).name for _ in range(3)]
    assert names == ["20261124-010203", "20261124-010203-2", "20261124-010203-3"]
    several = claim_launch_folder(tmp_path, True).name  # a node of a job of several
    assert several == f"20261124-010203-{socket.gethostname()}"


def test_the_tail_of_a_log_is_its_last_lines(tmp_path: Path) -> None:
    (tmp_path / "stderr.log").write_text("".join(f"line {i}\n" for i in range(100_000)))  # longer than it reads
    assert tail(tmp_path / "stderr.log", 3) == "line 99997\nline 99998\nline 99999"


def test_the_shutdown_timeout_reaches_torchruns_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """--shutdown-timeout (the sbatch script and the pods pass it): how long the agent waits, after a SIGTERM, for
    its ranks to save before it SIGKILLs them. Left out: torchrun's default, which TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    sets."""
    parser = build_parser()
    args = parser.parse_args(["run", "gpt", "--nnodes", "1", "--shutdown-timeout", "105"])  # as the sbatch script
    split_recipe_args(parser, args)
    argv = torchrun_argv(launch_options(args), ["x.py"], module=False)
    assert "--shutdown-timeout=105" in argv
    assert torchrun.config_from_args(torchrun.parse_args(argv))[0].shutdown_timeout == 105
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "77")
    argv = torchrun_argv(launch_options(build_parser().parse_args(["run", "gpt"])), ["x.py"], module=False)
    assert not any(a.startswith("--shutdown-timeout") for a in argv)
    assert torchrun.config_from_args(torchrun.parse_args(argv))[0].shutdown_timeout == 77
    with pytest.raises(LaunchError, match="--shutdown-timeout=0"):
        LaunchOptions(shutdown_timeout_s=0).check()


SAVED_TERM, SAVED_INT = ExitRecord(0, 75, True), ExitRecord(0, 130, True)


@pytest.mark.parametrize(
    ("sig", "records", "code", "not_stopped"),
    [
        (signal.SIGTERM, {0: SAVED_TERM, 1: ExitRecord(1, 75, True)}, 75, []),  # every rank saved and stopped
        (signal.SIGTERM, {0: SAVED_TERM, 1: ExitRecord(1, 1)}, 143, ["rank 1 did not stop with a checkpoint: exit"]),
        (signal.SIGTERM, {0: SAVED_TERM, 1: ExitRecord(1, None)}, 143, ["rank 1 did not stop", "--shutdown-timeout"]),
        (signal.SIGTERM, {0: SAVED_TERM}, 143, ["local rank 1 had not started"]),
        (signal.SIGTERM, {0: ExitRecord(0, 0), 1: ExitRecord(1, 0)}, 0, []),  # they had finished
        # None had started, or their records were lost (a full or cleaned /tmp): not claimed
        (signal.SIGTERM, {}, 143, ["local rank 0 had not started", "local rank 1 had not started"]),
        # Ctrl-C on another node: every rank stopped with 130, and with a checkpoint
        (signal.SIGTERM, {0: SAVED_INT, 1: ExitRecord(1, 130, True)}, 75, []),
        (signal.SIGTERM, {0: SAVED_TERM, 1: ExitRecord(None, None)}, 143, ["local rank 1 did not stop"]),
        (signal.SIGINT, {0: SAVED_INT, 1: ExitRecord(1, 130, True)}, 130, []),
        # Ctrl-C before a step boundary: 130 too, having saved nothing
        (signal.SIGINT, {0: SAVED_INT, 1: ExitRecord(1, 130, False)}, 130, ["rank 1 did not stop with a checkpoint"]),
        (signal.SIGHUP, {0: SAVED_TERM, 1: SAVED_TERM}, 129, []),
        (signal.SIGTERM, None, 143, []),  # a script: its exit codes are its own
    ],
)
def test_a_stop_is_claimed_only_when_every_rank_recorded_it(
    sig: signal.Signals,
    records: dict[int, ExitRecord] | None,
    code: int,
    not_stopped: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    hint = "trainmesh run gpt --resume --run-id r1"
    assert explain_stop(sig, records, LaunchOptions(nproc_per_node="2"), hint) == code
    claimed = f"every rank stopped at a step boundary with a checkpoint. Continue with: {hint}"
    assert (claimed in caplog.text) == (bool(records) and not not_stopped and code in (75, 130))
    for text in not_stopped:
        assert text in caplog.text
    assert ("did not stop with a checkpoint" in caplog.text) == bool(not_stopped and "started" not in not_stopped[0])
    assert ("not every rank stopped with a checkpoint" in caplog.text) == bool(not_stopped)


def test_workers_record_their_start_and_exit_for_their_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    record_start()  # no folder named (srun, mpirun): nothing is written
    with records_folder() as folder:
        assert os.environ[exit_records.ENV_VAR] == str(folder)
        assert read_records(folder) == {}
        record_start()
        assert read_records(folder) == {1: ExitRecord(5, None)}
        record_exit(75, stopped_with_checkpoint=True)
        (folder / "local_rank_0").write_text('{"rank": 4, "exit')  # torn: as if it had not returned
        (folder / "local_rank_1.999").write_text("being written")
        assert read_records(folder) == {0: ExitRecord(None, None), 1: ExitRecord(5, 75, True)}
        record_start()  # a restarted attempt's worker: the earlier attempt's exit is not its own
        assert read_records(folder)[1] == ExitRecord(5, None)
    assert not folder.exists() and exit_records.ENV_VAR not in os.environ


@pytest.mark.parametrize("flag", ["--master-addr", "--rdzv-endpoint"])
def test_in_a_pod_a_peer_name_may_take_until_the_join_timeout_to_resolve(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, flag: str
) -> None:
    """A pod's rendezvous host is another pod's name (a headless service's record), which resolves only once
    that pod runs: in a pod, the launch keeps trying until --join-timeout; elsewhere a wrong name fails at once."""
    import trainmesh.launch.options as launch_module

    real = socket.getaddrinfo
    tries: list[str] = []

    def pod_starting(host: str, *args: object, **kwargs: object) -> object:
        tries.append(host)
        if host == "gpt-worker-0.gpt" and len(tries) < 3:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real("127.0.0.1", *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", pod_starting)
    monkeypatch.setattr(launch_module, "DNS_RETRY_S", 0.01)
    opts = (
        LaunchOptions(nnodes="2", master_addr="gpt-worker-0.gpt", master_port=29500, join_timeout_s=5)
        if flag == "--master-addr"
        else LaunchOptions(nnodes="1:2", rdzv_endpoint="gpt-worker-0.gpt:29400", join_timeout_s=5)
    )
    with pytest.raises(
        LaunchError, match=rf"{flag}='gpt-worker-0.gpt' does not resolve \(Name or service not known\)\."
    ):
        opts.check()  # not in a pod: at once
    assert len(tries) == 1
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    tries.clear()
    with caplog.at_level("INFO", logger="trainmesh"):
        opts.check()
    assert len(tries) == 3 and f"{flag}=gpt-worker-0.gpt does not resolve yet" in caplog.text

    def stopped(host: str, *args: object, **kwargs: object) -> object:  # the pod is deleted as it waits
        signal.raise_signal(signal.SIGTERM)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", stopped)
    with pytest.raises(LaunchError, match="stopped by SIGTERM while waiting for .* to resolve; nothing was started"):
        opts.check()  # at once, not after --join-timeout: a container's PID 1 would ignore the SIGTERM
    never = dataclasses.replace(opts, join_timeout_s=1)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: (_ for _ in ()).throw(socket.gaierror(-2, "unknown")))
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"does not resolve \(unknown\) for 1 s \(--join-timeout\)"):
        never.check()
    assert 1 <= time.monotonic() - started < 5
