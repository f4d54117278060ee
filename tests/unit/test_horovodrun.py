"""`trainmesh horovodrun`: horovodrun's command line translated to trainmesh run's launch options, and refused
(naming the flag, what is supported and what to do) where there is no counterpart."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from trainmesh.cli import main
from trainmesh.compat.horovodrun import HorovodrunArgs, HorovodrunError, launch_options, parse


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("import trainmesh.horovod as hvd\n")
    return "train.py"


def _parsed(argv: list[str]) -> HorovodrunArgs:
    args = parse(argv)
    assert args is not None
    return args


def test_np_becomes_nproc_per_node_and_the_command_is_kept(script: str) -> None:
    for argv in (
        ["-np", "4", "python", script, "--epochs", "3"],
        ["--num-proc=4", "python3", "-u", script, "--epochs", "3"],
        ["-np", "4", "-H", "localhost:4", script, "--epochs", "3"],
        ["-np", "4", "--hosts", "localhost:8", "--gloo", "--verbose", "/usr/bin/python3.11", script, "--epochs", "3"],
    ):
        args = _parsed(argv)
        assert (args.np, args.entry, args.module) == (4, (script, "--epochs", "3"), False), argv
        opts = launch_options(args)
        assert (opts.nproc_per_node, opts.nnodes, opts.join_timeout_s) == ("4", "1", 300)
    args = _parsed(["-np", "2", "--start-timeout", "45", "python", "-m", "pkg.train", "--lr", "0.1"])
    assert (args.entry, args.module, launch_options(args).join_timeout_s) == (("pkg.train", "--lr", "0.1"), True, 45)
    assert parse(["--help"]) is None and parse(["-np", "2", "-h"]) is None


def test_hosts_fill_in_order_as_horovodrun(script: str) -> None:
    args = _parsed(["-np", "6", "-H", "a:4,b:4,c", script])
    assert args.hosts == (("a", 4), ("b", 4), ("c", 1)) and args.allocation() == [("a", 4), ("b", 2)]
    Path("hosts").write_text("# cluster\na slots=2\nb slots = 2  # second\n\nc:3\n")
    assert _parsed(["-np", "4", "--hostfile", "hosts", script]).hosts == (("a", 2), ("b", 2), ("c", 3))


def test_several_hosts_are_refused_with_the_command_for_each(script: str) -> None:
    with pytest.raises(HorovodrunError) as e:
        launch_options(_parsed(["-np", "8", "-H", "n1:4,n2:4", "--start-timeout", "60", script, "--epochs", "2"]))
    message = str(e.value)
    assert message.startswith("-np 8 over 2 hosts puts 4 on n1, 4 on n2; trainmesh does not start processes on other")
    common = "--master-addr n1 --master-port 29500 --join-timeout 60 --nproc-per-node 4 train.py --epochs 2"
    assert f"  on n1: trainmesh run --nnodes 2 --node-rank 0 {common}" in message
    assert f"  on n2: trainmesh run --nnodes 2 --node-rank 1 {common}" in message
    with pytest.raises(HorovodrunError, match=r"puts 4 on n1, 2 on n2, but torchrun starts the same number"):
        launch_options(_parsed(["-np", "6", "-H", "n1:4,n2:4", script]))
    with pytest.raises(
        HorovodrunError, match=r"-H gpu7:4 is another machine.*Fix: run this command on gpu7 without -H"
    ):
        launch_options(_parsed(["-np", "4", "-H", "gpu7:4", script]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["-np", "2", "--fusion-threshold-mb", "32", "x.py"],
            "flag --fusion-threshold-mb is not supported: a Horovod tuning",
        ),
        (["-np", "2", "--mpi", "x.py"], "flag --mpi is not supported: trainmesh launches with torchrun"),
        (
            ["-np", "2", "--min-np", "1", "x.py"],
            "horovodrun's elastic launch has no counterpart here: hvd.elastic scripts run under torchrun's elastic",
        ),
        (["-np", "2", "--timeline-filename", "t.json", "x.py"], "timeline is not supported: record the collectives"),
        (["-np", "2", "-p", "22", "x.py"], "trainmesh does not ssh into hosts"),
        (["-np", "2", "--frobnicate", "x.py"], "unknown horovodrun flag '--frobnicate'. Supported: -np/--num-proc, -H"),
        (["python", "train.py"], "-np N is required"),
        (["-np", "0", "train.py"], "-np '0': expected a whole number >= 1"),
        (["-np", "8", "-H", "localhost:4", "train.py"], "-np 8 asks for more processes than the hosts' 4 slots"),
        (["-np", "2", "-H", "a:1", "--hostfile", "h", "train.py"], "-H/--hosts and --hostfile both given"),
        (["-np", "2"], "no command after horovodrun's flags: give the Python script"),
        (["-np", "2", "bash", "run.sh"], "'bash' is not a Python script"),
        (["-np", "2", "python", "-c", "print(1)"], "only 'python [-u] script.py' and 'python -m module'"),
        (["-np", "2", "python", "missing.py"], "script 'missing.py' does not exist"),
        (["-np"], "flag -np needs a value"),
    ],
)
def test_what_cannot_be_mapped_is_refused_by_name(script: str, argv: list[str], message: str) -> None:
    with pytest.raises(HorovodrunError) as e:
        parse(argv)
    assert message in str(e.value)
    if "Supported" in str(e.value) or "not supported" in str(e.value):
        assert "Supported: -np/--num-proc, -H/--hosts, --hostfile, --start-timeout, --gloo, --verbose" in str(e.value)


def test_the_cli_prints_help_and_exits_2_on_a_refused_flag(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["horovodrun", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: trainmesh horovodrun -np N")
    assert main(["horovodrun", "-np", "2", "--autotune", "python", script]) == 2
    assert "horovodrun flag --autotune is not supported" in capsys.readouterr().err
    assert main(["horovodrun", "-np", "2", "-H", "n1:1,n2:1", script]) == 2
    assert "on n2: trainmesh run --nnodes 2 --node-rank 1" in capsys.readouterr().err


def test_printed_commands_quote_every_word(script: str, tmp_path: Path) -> None:
    """The commands printed for several hosts are pasted into shells: each word stays one word and nothing in it
    runs (a host name is checked at parse; quoting is the printer's own guard)."""
    entry = (str(tmp_path / "my dir" / "train.py"), "--name", "it's $(id)")
    args = HorovodrunArgs(2, (("n1 $(id)", 1), ("n2", 1)), 60, entry, module=False)
    with pytest.raises(HorovodrunError) as e:
        launch_options(args)
    line = next(x for x in str(e.value).splitlines() if x.startswith("  on n2: "))
    words = shlex.split(line.removeprefix("  on n2: "))
    assert words[:4] == ["trainmesh", "run", "--nnodes", "2"] and words[-3:] == list(entry)
    assert words[words.index("--master-addr") + 1] == "n1 $(id)" and words[words.index("--join-timeout") + 1] == "60"
    module = HorovodrunArgs(2, (("n1", 1), ("n2", 1)), 60, ("pkg.train", "--lr", "0.1"), module=True)
    with pytest.raises(HorovodrunError) as e:
        launch_options(module)
    expected = "--master-addr n1 --master-port 29500 --rdzv-conf=timeout=60 --nproc-per-node 1 -m pkg.train --lr 0.1"
    assert f"  on n2: torchrun --nnodes 2 --node-rank 1 {expected}" in str(e.value)  # torchrun has no --join-timeout


@pytest.mark.parametrize("hosts", ["a$(touch x):1,b:1", "a;b:2", "-oProxyCommand=x:1", "a b:1", "'a':1"])
def test_host_names_that_are_not_host_names_are_refused(
    script: str, hosts: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["horovodrun", "-np", "2", "-H", hosts, script]) == 2
    err = capsys.readouterr().err
    assert "is not a host name" in err and "letters, digits and ._:-" in err and "Traceback" not in err
    assert "trainmesh run" not in err  # no command printed with it


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("-H", "a:1,b:x", "-H a:1,b:x: the slots of b 'x': expected a whole number >= 1"),
        ("--hostfile", "hosts", "--hostfile hosts: the slots of b '0': expected a whole number >= 1"),
        ("--hostfile", "empty", "--hostfile empty: no host. Fix: one 'HOST slots=N' per line"),
    ],
)
def test_a_bad_slot_count_names_the_flag_it_came_from(script: str, flag: str, value: str, message: str) -> None:
    Path("hosts").write_text("a slots=1\nb slots=0\n")
    Path("empty").write_text("# no hosts yet\n")
    with pytest.raises(HorovodrunError) as error:
        parse(["-np", "1", flag, value, script])
    assert str(error.value).startswith(message), error.value


def test_host_names_and_addresses_pass_and_a_host_file_is_checked_too(script: str) -> None:
    Path("hosts").write_text("n1 slots=1\nn$(id) slots=1\n")
    with pytest.raises(
        HorovodrunError, match=r"--hostfile hosts: 'n\$\(id\)' is not a host name.* Fix: one 'HOST slots"
    ):
        parse(["-np", "2", "--hostfile", "hosts", script])
    assert _parsed(["-np", "2", "-H", "gpu-01.cluster_a:1,10.0.0.2:1,::1:1", script]).hosts == (
        ("gpu-01.cluster_a", 1),
        ("10.0.0.2", 1),
        ("::1", 1),
    )
