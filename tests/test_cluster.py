"""The virtual cluster (heatlike.testing.cluster): nodes MPI sees as separate, traffic that
really crosses the links and is counted, teardown that leaves nothing, clear messages where it
cannot run. The tests that create nodes need root, iproute2 and util-linux and are skipped with
the reason elsewhere; the last test runs on the nodes themselves in the matrix's --real-nodes
run."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from heatlike.testing import cluster as cl
from heatlike.testing.cluster import (
    ClusterError,
    ClusterUnavailable,
    TrafficError,
    VirtualCluster,
    parse_rate,
    parse_sizes,
)

REASON = cl.unavailable_reason()


def _hydra_reason() -> str | None:
    try:
        cl._find_mpiexec(None)
    except ClusterError as e:
        return str(e)
    return None


def _name(prefix: str) -> str:
    """A cluster name of this process (several test runs may share the machine)."""
    return f"{prefix}{os.getpid() % 100000}"


def _skip_unless_possible() -> None:
    if REASON:
        pytest.skip(f"virtual cluster unavailable: {REASON}")
    why = _hydra_reason()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of 2 and 1 ranks on 1 Gbit/s links."""
    _skip_unless_possible()
    c = VirtualCluster([2, 1], rate="1gbit", name=_name("hlt"))
    with c:
        yield c
    _assert_gone(c)


def _netns(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def _assert_gone(c: VirtualCluster) -> None:
    """Nothing of the cluster is left: namespaces, links, bridge, mounts, files, processes."""
    assert _netns(c.name) == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert not re.search(rf"^\d+: {c.name}-", links, flags=re.M), links
    assert not c.state_dir.exists()
    assert str(c.state_dir) not in Path("/proc/mounts").read_text()
    assert not list(Path("/etc/netns").glob(f"{c.name}-*")) if Path("/etc/netns").exists() \
        else True


def _tagged_anywhere(name: str) -> list[int]:
    """Processes started by a job of cluster ``name`` (HEATLIKE_CLUSTER=name in their env)."""
    needle = f"HEATLIKE_CLUSTER={name}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in env and state != "Z":
                found.append(int(pid))
    return found


def _in_nodes(c: VirtualCluster) -> list[int]:
    return [p for n in c.nodes for p in cl._netns_pids(n.netns)]


# a rank program: mpi4py only (starts in a second), no heatlike import
PROBE = """
import json, sys
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
node = comm.Split_type(MPI.COMM_TYPE_SHARED)
leader = node.allreduce(comm.rank, op=MPI.MIN)
count = int(sys.argv[2])
x = np.full(count, comm.rank + 1.0, dtype=np.float32)
if count:
    comm.Allreduce(MPI.IN_PLACE, x)
rows = comm.gather({"rank": comm.rank, "host": MPI.Get_processor_name(), "leader": leader,
                    "node_size": node.size, "sum": float(x[0]) if count else 0.0})
if comm.rank == 0:
    open(sys.argv[1], "w").write(json.dumps(rows))
"""

SLEEPER = """
import subprocess, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Barrier()
# a child in a session of its own, as a helper process of a rank might be
subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
open(f"{sys.argv[1]}.{comm.rank}", "w").write(str(MPI.Get_processor_name()))
time.sleep(600)
"""


def _script(tmp_path: Path, text: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _wait_files(prefix: Path, count: int, timeout: float = 120,
                stop: threading.Event | None = None) -> bool:
    """Wait until ``count`` ranks wrote ``prefix.<rank>``: True, or False when ``stop`` was set
    first (the job ended); AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(prefix.parent.glob(prefix.name + ".*"))) == count:
            return True
        if stop is not None and stop.is_set():
            return False
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start within {timeout} s")


# ------------------------------------------------------------------ anywhere (no root needed)


def test_bad_arguments_are_clear():
    assert parse_rate("1gbit") == 125e6 and parse_rate("10GBIT") == 1.25e9
    for bad in ("fast", "0gbit", "-1mbit", "1 gigabit", "", "40tbit", "0.001bit"):
        with pytest.raises(ValueError, match="link rate"):  # (tc refused the last two)
            parse_rate(bad)
    assert parse_sizes("2,1") == [2, 1] and parse_sizes("3x2") == [2, 2, 2]
    assert parse_sizes([1, 1]) == [1, 1]
    for bad in ("0,1", "", "a,b", [], "2x0"):
        with pytest.raises(ValueError, match="nodes"):
            parse_sizes(bad)
    for bad in ("", "Hlc", "1abc", "toolongname", "a-b"):
        with pytest.raises(ValueError, match="cluster name"):
            VirtualCluster([1], name=bad)


def test_placement():
    c = VirtualCluster([2, 1])
    assert c.placement() == [2, 1]
    assert c.placement(n=3) == [2, 1] and c.placement(n=2) == [2, 0]
    assert c.placement(1) == [1, 1] and c.placement([2, 0]) == [2, 0]
    assert c.placement([1]) == [1, 0]
    for bad in ({"n": 4}, {"n": 0}, {"ranks_per_node": [0, 0]},
                {"ranks_per_node": [1, 1, 1]}, {"ranks_per_node": [-1, 2]},
                {"ranks_per_node": 1, "n": 2}):
        with pytest.raises(ValueError):
            c.placement(**bad)


@pytest.mark.parametrize("missing", ["root", "tc", "unshare"])
def test_unavailable_is_said(monkeypatch, capsys, missing):
    """Not root, or a tool missing: up() raises ClusterUnavailable naming what is missing, the
    command line says so with exit status 2, and nothing is created."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    if missing == "root":
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    else:
        real = cl.shutil.which
        monkeypatch.setattr(cl.shutil, "which", lambda t: None if t == missing else real(t))
    reason = cl.unavailable_reason()
    assert reason and missing in reason
    c = VirtualCluster([1, 1], name=_name("hlx"))
    with pytest.raises(ClusterUnavailable, match=missing):
        c.up()
    assert not c.state_dir.exists()
    assert cl.main(["--name", c.name, "up"]) == 2
    assert missing in capsys.readouterr().err
    assert cl.main(["check"]) == 2
    assert missing in capsys.readouterr().out


def test_refused_namespaces_are_said(monkeypatch):
    """A kernel or container that refuses namespaces: the refused command and its message."""
    if REASON:
        pytest.skip(f"virtual cluster unavailable: {REASON}")
    real = cl._cmd

    def refuse(*args, check=True, timeout=60):
        if args[:3] == ("ip", "netns", "add"):
            return subprocess.CompletedProcess(list(args), 1, "",
                                               "mount --make-shared /run/netns failed: "
                                               "Operation not permitted")
        return real(*args, check=check, timeout=timeout)

    monkeypatch.setattr(cl, "_cmd", refuse)
    reason = cl.unavailable_reason()
    assert "refused `ip netns add" in reason and "Operation not permitted" in reason


def test_no_cluster_up_is_said(capsys):
    assert cl.main(["--name", _name("hln"), "run", "--", "true"]) == 2
    assert "no cluster" in capsys.readouterr().err
    with pytest.raises(ClusterError, match="no cluster"):
        VirtualCluster.existing(_name("hln"))


# ------------------------------------------------------------------ on a cluster


@pytest.mark.system
def test_mpi_sees_the_nodes(cluster, tmp_path):
    """3 ranks on nodes of 2 and 1: Split_type gives one communicator per node, the hostnames
    differ between nodes, the all-reduce across them is right."""
    out = tmp_path / "rows.json"
    probe = _script(tmp_path, PROBE, "probe.py")
    r = cluster.run([sys.executable, probe, str(out), "1000"], timeout=120)
    assert r.returncode == 0, r.report()
    rows = json.loads(out.read_text())
    assert [row["host"] for row in rows] == ["node1", "node1", "node2"]
    assert [row["leader"] for row in rows] == [0, 0, 2]
    assert [row["node_size"] for row in rows] == [2, 2, 1]
    assert all(row["sum"] == 6.0 for row in rows)


@pytest.mark.system
def test_traffic_crosses_the_links(cluster, tmp_path):
    """A 4 MB all-reduce across the nodes puts megabytes on both links; the same on one node
    puts only the launcher's few KB on node1's link and nothing on node2's."""
    out = tmp_path / "rows.json"
    probe = _script(tmp_path, PROBE, "probe.py")
    count = 1 << 20  # 4 MB of float32
    r = cluster.run([sys.executable, probe, str(out), str(count)], timeout=120,
                    require_traffic=True)
    assert r.returncode == 0, r.report()
    assert r.crossed and not r.warning
    assert r.between_nodes >= 2 * 4 * count, r.report()
    for host in ("node1", "node2"):
        assert r.sent[host] >= 4 * count, r.report()  # each node sends its 4 MB at least once
        assert r.received[host] >= 4 * count, r.report()
    one = cluster.run([sys.executable, probe, str(out), str(count)], [2, 0], timeout=120,
                      require_traffic=True)
    assert one.returncode == 0, one.report()
    assert one.crossed is None and not one.warning
    assert one.sent["node1"] < 64 * 1024, one.report()  # mpiexec's control messages only
    assert one.sent["node2"] < 1024 and one.received["node2"] < 4096, one.report()
    assert [row["host"] for row in json.loads(out.read_text())] == ["node1", "node1"]


@pytest.mark.system
@pytest.mark.parametrize("mode", ["--non-blocking", "--blocking"])
def test_the_digits_example_ends_without_transport_warnings(cluster, mode, tmp_path):
    """Data-parallel training across the nodes over TCP leaves nothing unreceived: no transport
    warning (UCX once printed "unexpected tag-receive descriptor ... was not matched" at the end
    of every DataParallel run on two nodes), and the traffic crossed the links."""
    root = Path(__file__).resolve().parent.parent
    log = tmp_path / "digits.log"
    with open(log, "w") as out:
        r = cluster.run([sys.executable, "-m", "heatlike", str(root / "examples" / "digits.py"),
                         "--epochs", "1", mode], n=3, timeout=300, require_traffic=True,
                        stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert r.returncode == 0, r.report() + text
    assert "test accuracy:" in text, text
    assert not re.search(r"WARN|not matched|unexpected", text), text
    assert r.between_nodes > 1_000_000, r.report()


@pytest.mark.system
def test_no_traffic_is_reported(cluster, tmp_path, capsys):
    """A job on two nodes whose ranks do not talk over the network is reported, and fails with
    --require-traffic: a program that never communicates, and the shared-memory bypass of
    UCX's default transports (the namespaces share /dev/shm), which this cluster's settings
    prevent: a 4 MB all-reduce that puts nothing on the links. The launcher's own messages do
    not count."""
    out = tmp_path / "rows.json"
    probe = _script(tmp_path, PROBE, "probe.py")
    r = cluster.run(["true"], timeout=120)
    assert r.returncode == 0 and r.crossed is False, r.report()
    assert r.to_launcher > 0 and r.between_nodes < cl.MIN_BYTES
    assert "did not talk over the network" in r.warning and "WARNING" in r.report()
    # ranks that only print (3 MB to the launcher) still did not talk: the bridge's counter
    # lacks each frame's Ethernet header, which made 14 bytes per packet look like node traffic
    chatty = cluster.run(["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' a | fold -w 100"],
                         [1, 1], timeout=120)
    assert chatty.returncode == 0 and chatty.to_launcher > 3_000_000, chatty.report()
    assert chatty.between_nodes < cl.MIN_BYTES and chatty.crossed is False, chatty.report()
    with pytest.raises(TrafficError, match="did not talk over the network") as e:
        cluster.run(["true"], timeout=120, require_traffic=True)
    assert e.value.result.crossed is False
    bypass = cluster.run([sys.executable, probe, str(out), str(1 << 20)], timeout=120,
                         transport={})
    assert bypass.returncode == 0 and bypass.crossed is False, bypass.report()
    assert json.loads(out.read_text())[0]["sum"] == 6.0
    # the 4 MB all-reduce put less than 0.4% of itself on the links (neighbour discovery and
    # the launcher's connections make a few KB of their own)
    assert bypass.between_nodes < cl.MIN_BYTES, bypass.report()


@pytest.mark.system
def test_cli(cluster, tmp_path, capfd):
    """status, traffic, rate and link on the command line; run with --json and
    --require-traffic (exit status 3 when nothing crossed)."""
    name = ["--name", cluster.name]
    assert cl.main([*name, "status"]) == 0
    assert "node2" in capfd.readouterr().out
    assert cl.main([*name, "traffic"]) == 0
    assert re.search(r"node1 link_tx_bytes=\d+", capfd.readouterr().out)
    assert cl.main([*name, "rate", "2gbit"]) == 0
    assert VirtualCluster.existing(cluster.name).rate == "2gbit"
    qdisc = subprocess.run(["tc", "-n", cluster.nodes[0].netns, "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True).stdout
    assert "rate 2Gbit" in qdisc
    cluster.set_rate("1gbit")
    assert cl.main([*name, "link", "node2", "down"]) == 0
    assert "link down" in cluster.status()
    cluster.set_link(2, True)
    assert "link down" not in cluster.status()
    for bad, said in ((["run", "--ranks-per-node", "x", "--", "true"], "--ranks-per-node"),
                      (["run", "-n", "9", "--", "true"], "do not fit"),
                      (["run"], "give the command"),
                      (["rate", "fast"], "link rate"),
                      (["link", "node7", "down"], "no node")):
        assert cl.main([*name, *bad]) == 2, bad
        assert said in capfd.readouterr().err, bad
    report = tmp_path / "job.json"
    rc = cl.main([*name, "run", "-n", "3", "--require-traffic", "--json", str(report), "--",
                  "true"])
    assert rc == 3
    assert "WARNING" in capfd.readouterr().err
    data = json.loads(report.read_text())
    assert data["ranks_per_node"] == [2, 1] and data["crossed"] is False


@pytest.mark.system
def test_up_down_idempotent_and_leave_nothing():
    """up twice gives one cluster (same subnet, same namespaces), up with other sizes
    recreates it, down twice is fine, and down also finds a cluster whose state file is
    gone."""
    _skip_unless_possible()
    c = VirtualCluster([1, 1], rate="1gbit", name=_name("hlu"))
    try:
        c.up()
        subnet = c.subnet
        again = VirtualCluster([1, 1], rate="500mbit", name=c.name).up()
        assert again.subnet == subnet and again.is_up()
        assert VirtualCluster.existing(c.name).rate == "500mbit"
        assert sorted(_netns(c.name)) == [f"{c.name}-n1", f"{c.name}-n2"]
        # a rate tc cannot take changes nothing (the cluster was removed and not made again)
        with pytest.raises(ValueError, match="link rate"):
            VirtualCluster([1, 1], rate="40tbit", name=c.name).up()
        assert VirtualCluster.existing(c.name).rate == "500mbit"
        # other sizes while a process runs on a node: refused, nothing ended
        busy = subprocess.Popen(["ip", "netns", "exec", f"{c.name}-n1", "sleep", "60"])
        try:
            deadline = time.monotonic() + 10
            while not cl._netns_pids(f"{c.name}-n1") and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(ClusterError, match="process.* running on its nodes"):
                VirtualCluster([1, 1, 1], name=c.name).up()
            assert busy.poll() is None
        finally:
            busy.kill()
            busy.wait()
        bigger = VirtualCluster([1, 1, 1], name=c.name).up()
        assert sorted(_netns(c.name)) == [f"{c.name}-n{i}" for i in (1, 2, 3)]
        (bigger.state_dir / "cluster.json").unlink()  # the state is lost
        with pytest.raises(ClusterError, match="no cluster"):
            VirtualCluster.existing(c.name)
    finally:
        c.down()
    _assert_gone(c)
    c.down()
    _assert_gone(c)


@pytest.mark.system
def test_orphaned_temporary_cluster_is_removed():
    """A temporary cluster (the context manager's, the matrix's) whose process died without
    down() is removed by the next up() of any cluster; one created on the command line (no
    owner) is kept."""
    _skip_unless_possible()
    orphan = VirtualCluster([1], name=_name("hlo"))
    kept = VirtualCluster([1], name=_name("hlk"))
    other = VirtualCluster([1], name=_name("hlp"))
    try:
        orphan.up(temporary=True)
        kept.up()
        state = orphan.state_dir / "cluster.json"
        data = json.loads(state.read_text())
        assert data["owner"][0] == os.getpid()
        data["owner"] = [2 ** 22 + 1, "0"]  # above pid_max's default: no such process
        state.write_text(json.dumps(data))
        with other:
            assert _netns(orphan.name) == [] and not orphan.state_dir.exists()
            assert kept.is_up()
    finally:
        for c in (orphan, kept, other):
            c.down()
    for c in (orphan, kept, other):
        _assert_gone(c)


@pytest.mark.system
def test_timeout_and_killed_rank_end_the_job_everywhere(cluster, tmp_path):
    """A job past its timeout is ended on every node, helpers in sessions of their own
    included; a rank killed on node2 ends the job on every node with a non-zero status, the
    failed process's host named (and which node that address is)."""
    sleeper = _script(tmp_path, SLEEPER, "sleeper.py")
    ready = tmp_path / "ready"
    r = cluster.run([sys.executable, sleeper, str(ready)], timeout=12)
    assert r.returncode is None, r.report()
    assert r.seconds < 60
    assert _in_nodes(cluster) == [] and _tagged_anywhere(cluster.name) == []
    # kill the rank on node2 once all have started
    for f in tmp_path.glob("ready.*"):
        f.unlink()

    ended = threading.Event()

    def kill_rank_on_node2():
        if not _wait_files(ready, 3, stop=ended):
            return
        for pid in cl._netns_pids(cluster.nodes[1].netns):
            if sleeper in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_on_node2, daemon=True)
    killer.start()
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        r = cluster.run([sys.executable, sleeper, str(ready)], timeout=120, stdout=f,
                        stderr=subprocess.STDOUT)
    ended.set()
    killer.join()
    assert r.returncode not in (0, None), r.report()
    assert r.seconds < 100
    text = log.read_text()
    assert "BAD TERMINATION" in text and cluster.nodes[1].address in text, text
    assert f"{cluster.nodes[1].address} is node2" in r.report()
    assert _in_nodes(cluster) == [] and _tagged_anywhere(cluster.name) == []


LOOP = """
import sys, time
import torch
import heatlike as hl
comm = hl.MPI_WORLD
x = torch.ones(1 << 16)
comm.Allreduce(hl.IN_PLACE, x)
open(f"{sys.argv[1]}.{comm.rank}", "w").write("1")
while True:
    comm.Allreduce(hl.IN_PLACE, x.fill_(1.0))
"""


@pytest.mark.system
@pytest.mark.slow  # three ranks importing heatlike
def test_link_down_mid_run_is_a_timeout_naming_the_rank(cluster, tmp_path):
    """node2's link goes down while the ranks all-reduce in a loop: within
    HEATLIKE_COMM_TIMEOUT the ranks of node1 raise TimeoutError naming rank 2 (the one on
    node2) among the ranks that have not arrived, the job ends, nothing is left on either
    node."""
    script = _script(tmp_path, LOOP, "loop.py")
    ready = tmp_path / "ready"
    cut = []
    ended = threading.Event()

    def cut_node2():
        if not _wait_files(ready, 3, timeout=200, stop=ended):
            return
        time.sleep(1)
        cut.append(time.monotonic())
        cluster.set_link(2, False)

    cutter = threading.Thread(target=cut_node2, daemon=True)
    cutter.start()
    log = tmp_path / "job.log"
    try:
        with open(log, "w") as f:
            r = cluster.run([sys.executable, "-m", "heatlike", script, str(ready)],
                            env={**os.environ, "HEATLIKE_COMM_TIMEOUT": "5"}, timeout=240,
                            stdout=f, stderr=subprocess.STDOUT)
        ended.set()
        finished = time.monotonic()
        cutter.join()
    finally:
        ended.set()
        cluster.set_link(2, True)
    text = log.read_text()
    assert cut, "the ranks did not start\n" + text
    assert r.returncode not in (0, None), r.report() + "\n" + text
    assert finished - cut[0] < 60, r.report()
    # the ranks of node1 name rank 2 (they may also name each other: a rank busy in its own
    # wait does not answer the one-sided read of its record over TCP)
    found = re.findall(r"TimeoutError: Allreduce .* did not complete within 5 s "
                       r"\(HEATLIKE_COMM_TIMEOUT\); ranks \[([0-9, ]+)\] have not arrived", text)
    assert found and all("2" in ranks.split(", ") for ranks in found), text
    assert _in_nodes(cluster) == [] and _tagged_anywhere(cluster.name) == []


@pytest.mark.system
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_stopped_runner_leaves_nothing(cluster, tmp_path, signum):
    """SIGTERM to `run` on the command line ends the job's processes on every node (status
    128 + 15); SIGKILL, which `run` cannot handle, is answered by its reaper: nothing is left
    either way."""
    from heatlike.testing.matrix import _clean_env

    sleeper = _script(tmp_path, SLEEPER, "sleeper.py")
    ready = tmp_path / "ready"
    # (the environment of this test's own MPI job must not reach the command's MPI start-up)
    proc = subprocess.Popen([sys.executable, "-m", "heatlike.testing.cluster", "--name",
                             cluster.name, "run", "--", sys.executable, sleeper, str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_clean_env())
    try:
        _wait_files(ready, 3)
        assert len(_in_nodes(cluster)) >= 3
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if signum == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, out
        assert "stopped by SIGTERM" in out
    deadline = time.monotonic() + 30
    while (_in_nodes(cluster) or _tagged_anywhere(cluster.name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _in_nodes(cluster) == [] and _tagged_anywhere(cluster.name) == []


# ------------------------------------------------------------------ the test matrix on a cluster

SUITE = """
import os
import numpy as np
import pytest
from mpi4py import MPI

@pytest.mark.mpi
def test_on_the_nodes():
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    layout = os.environ.get("HEATLIKE_CLUSTER_RANKS")
    if layout:
        assert node.size == 1 and layout == "1,1"
    x = np.ones(1 << 18)
    comm.Allreduce(MPI.IN_PLACE, x)
    assert x[0] == comm.size
"""


@pytest.mark.system
@pytest.mark.slow  # a matrix runner and two launches
def test_matrix_runs_on_real_nodes(tmp_path):
    """--real-nodes 2 runs the multi-rank tests on two nodes of a virtual cluster (one rank
    each at --sizes 2) instead of the emulated run, shows the bytes between the nodes, and
    removes the cluster afterwards."""
    _skip_unless_possible()
    from heatlike.testing.matrix import _clean_env

    (tmp_path / "test_suite.py").write_text(SUITE)
    cmd = [sys.executable, "-m", "heatlike.testing.matrix", "--sizes", "2", "--fake-nodes", "2",
           "--real-nodes", "2", "--mpiexec", " ".join(cl._find_mpiexec(None)),
           "--log-dir", str(tmp_path / "logs"), "--", str(tmp_path), "-p",
           "heatlike.testing.plugin", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=_clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out[out.index("### test matrix summary"):]
    assert re.search(r"np=2, 2 real nodes +passed", summary), summary
    assert "emulated" not in summary, summary
    between = re.search(r"between the nodes ([0-9.]+) MB", summary)
    assert between and float(between.group(1)) >= 2.0, summary  # 2 MB all-reduced
    name = re.search(r"virtual cluster (hlm[0-9]+)", summary).group(1)
    assert _netns(name) == [] and not (cl.STATE_ROOT / name).exists()


def test_matrix_falls_back_when_the_cluster_cannot_start(monkeypatch, capsys):
    """Without root the --real-nodes run is not created and the reason is given (the matrix
    then runs the emulated nodes instead, noting it in the summary)."""
    import argparse

    from heatlike.testing import matrix

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    opts = argparse.Namespace(real_nodes=2, link_rate="10gbit", mpiexec="mpiexec")
    run, why = matrix._real_nodes_run(opts, 4, [])
    assert run is None and "needs root" in why
    assert "needs root" in capsys.readouterr().out


# ------------------------------------------------------------------ on the nodes themselves


@pytest.mark.mpi(min_size=2)
def test_real_nodes_layout(comm):
    """In the matrix's --real-nodes run: heatlike's Topology finds the cluster's nodes (blocks of
    HEATLIKE_CLUSTER_RANKS ranks, one hostname per node) without any override."""
    from mpi4py import MPI

    from heatlike.core.topology import Topology

    layout = os.environ.get("HEATLIKE_CLUSTER_RANKS")
    if not layout:
        pytest.skip("not on a virtual cluster (the matrix's --real-nodes run)")
    assert "HEATLIKE_RANKS_PER_NODE" not in os.environ
    expected = [i for i, k in enumerate(int(k) for k in layout.split(",") if int(k))
                for _ in range(k)]
    t = Topology(comm)
    try:
        assert list(t.node_ids) == expected
        hosts = comm.handle.allgather(MPI.Get_processor_name())
        assert len(set(hosts)) == t.num_nodes
        assert all((hosts[a] == hosts[b]) == (expected[a] == expected[b])
                   for a in range(comm.size) for b in range(comm.size))
    finally:
        t.free()
