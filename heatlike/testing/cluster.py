"""A virtual cluster on one machine: nodes that MPI sees as separate, joined by rate-limited links
that the inter-node traffic really crosses.

    python -m heatlike.testing.cluster [--name hlc] up [--nodes 2,2] [--rate 1gbit]
    python -m heatlike.testing.cluster run [-n P | --ranks-per-node 2,1] [--require-traffic]
                                           [--min-bytes B] [--timeout S] [--json FILE] -- CMD...
    python -m heatlike.testing.cluster traffic | status | check | down [--all]
    python -m heatlike.testing.cluster rate 10gbit
    python -m heatlike.testing.cluster link node2 down|up
    python -m heatlike.testing.cluster slurm up|status|env|down
    python -m heatlike.testing.cluster slurm sbatch -- [SBATCH OPTIONS] SCRIPT

What a node is. Node *i* (``node1``, ``node2``, ...) is a Linux network namespace
(``<name>-n<i>``) with one interface, ``eth0``, at ``10.78.K.i/24``: one end of a veth pair whose
other end (``<name>-h<i>``) is plugged into a bridge (``<name>-br``, ``10.78.K.254``) in the
machine's own namespace. The node's egress is limited by a token bucket (``tc tbf``) at the link
rate, as a NIC would be; every process of a node also shares the node's UTS namespace (its
hostname is ``node<i>``) and sees ``/etc/hosts`` naming every node. ``K`` is the first subnet no
other cluster and no interface of the machine uses; the addresses exist only inside the
namespaces the cluster creates, and traffic flows only between them and the bridge.

What is not real: the nodes share one kernel, the CPU cores, the file system, ``/dev/shm`` and
the boot id. A transport that looks for shared memory (UCX's ``sm``/``cma``, libfabric's
``shm``) therefore finds the other "node" reachable and bypasses the link. ``run`` forces the
inter-node transport onto the network: ``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=eth0``,
``FI_PROVIDER=tcp`` and ``FI_TCP_IFACE=eth0`` (MPICH keeps its own shared memory between the
ranks of one node). ``HEATLIKE_RANKS_PER_NODE`` and ``HEATLIKE_NODE_IDS`` are removed from the
job's environment, so that the ranks find their nodes as on a cluster
(``Split_type(COMM_TYPE_SHARED)``).

Launching. ``run`` starts MPICH's Hydra ``mpiexec`` on the machine (the "login node") with
``-launcher rsh -launcher-exec <agent> -iface <bridge> -hosts 10.78.K.1:k1,...``; the agent, a
shell script written by ``up``, starts each node's proxy inside that node's namespaces (the
proxies connect back to ``mpiexec`` over the node's link, a few KB per launch). Ranks are placed
in blocks: the first ``k1`` on node1, and so on.

Verified traffic. ``run`` reads every node's interface counters before and after the job and
reports the bytes each node sent on its link (and on its loopback); the bridge's own counter
gives the part addressed to the machine (``mpiexec``'s control connections), the rest is what
the nodes sent each other. A job placed on several nodes whose nodes sent each other fewer than
``--min-bytes`` (default 16 KiB) is reported with a warning: its ranks did not talk over the
network, and any timing of it says nothing about the links. (MPICH's start-up over UCX's TCP
transport alone moves about 35 KB between two nodes; the shared-memory bypass moves about 1 KB.)
With ``--require-traffic`` that is an error (exit status 3).

Teardown. SIGTERM, SIGINT or SIGHUP to ``run``, the end of ``--timeout`` or the death of its
parent ends ``mpiexec`` and everything it started on every node; every process that still carries
the job's tag (``HEATLIKE_CLUSTER_JOB`` in its environment) is then killed. ``down`` kills every
process left in the nodes' namespaces and removes the namespaces, links, bridge, mounts and
files (and stops a SLURM started on it); it also finds the pieces of a cluster whose state
was lost. ``up`` and ``down`` are
idempotent.

Requirements: Linux, root, ``ip`` and ``tc`` (iproute2), ``unshare`` and ``nsenter``
(util-linux), and a kernel that allows network namespaces, veth, bridges and ``tbf``;
:func:`unavailable_reason` says what is missing. Exit statuses: 0 success, the job's own status
when it failed, 2 when the cluster cannot be used, 3 when ``--require-traffic`` found no
traffic, 124 after ``--timeout``, 128 + N when stopped by signal N.

SLURM. ``slurm up`` runs a real SLURM on the nodes (controller on the machine, one ``slurmd`` per
node), so that batch scripts go through ``sbatch`` and ``srun`` as on a cluster: see
:mod:`heatlike.testing.slurm`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.env import env_str
from . import _reaper

__all__ = ["VirtualCluster", "Node", "LinkCounters", "Job", "JobResult", "ClusterError",
           "ClusterUnavailable", "TrafficError", "unavailable_reason", "parse_rate",
           "parse_sizes", "DEFAULT_NAME", "MIN_BYTES", "TRANSPORT_ENV"]

DEFAULT_NAME = "hlc"
MIN_BYTES = 16 * 1024  # nodes of a job that send each other less did not use the links
NIC = "eth0"  # the name of every node's interface, inside its namespace
SUBNET_PREFIX = "10.78"
JOB_TAG = _reaper.TAG_VARIABLE  # HEATLIKE_CLUSTER_JOB
STATE_ROOT = Path(env_str("HEATLIKE_CLUSTER_STATE", "/run/heatlike-cluster"))
TOOLS = ("ip", "tc", "unshare", "nsenter")
# the transport settings that keep inter-node traffic on the link (see the module docstring)
TRANSPORT_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": NIC, "FI_PROVIDER": "tcp",
                 "FI_TCP_IFACE": NIC}
# layout overrides that would hide the real nodes from heatlike.core.topology
LAYOUT_ENV = ("HEATLIKE_RANKS_PER_NODE", "HEATLIKE_NODE_IDS")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}


class ClusterError(RuntimeError):
    """The cluster could not be created, used or removed (the message says which step)."""


class ClusterUnavailable(ClusterError):
    """This machine cannot run the cluster (not root, a tool missing, namespaces refused)."""


class TrafficError(ClusterError):
    """A job placed on several nodes moved (almost) nothing over the links; ``result`` is its
    :class:`JobResult`."""

    def __init__(self, message: str, result: JobResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class Node:
    """One node: its hostname, address, network namespace, bridge-side link and default size."""

    index: int  # 1-based
    hostname: str
    address: str
    netns: str
    host_link: str
    slots: int


@dataclass(frozen=True)
class LinkCounters:
    """A node's interface counters (bytes since ``up``): sent and received on its link, sent on
    its loopback."""

    tx: int
    rx: int
    lo_tx: int


@dataclass
class Job:
    """A job being run (see :meth:`VirtualCluster.job`): the ``mpiexec`` prefix to launch with,
    its environment, its tag and its :class:`JobResult` (filled in when the block ends)."""

    command: list[str]
    env: dict[str, str]
    tag: str
    result: JobResult


@dataclass
class JobResult:
    """What one :meth:`VirtualCluster.run` did. ``sent``/``received``/``loopback`` map each
    node's hostname to the bytes it sent on / received from its link and sent on its loopback
    during the job; ``to_launcher`` is the part of ``sent`` addressed to the machine itself
    (``mpiexec`` and its proxies' control messages), so ``between_nodes`` is what the nodes sent
    each other. ``crossed`` is None for a job on one node, else whether ``between_nodes`` is at
    least ``min_bytes``."""

    command: list[str]
    returncode: int | None  # None: ended after the timeout
    seconds: float
    ranks_per_node: list[int]
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    loopback: dict[str, int] = field(default_factory=dict)
    to_launcher: int = 0
    min_bytes: int = MIN_BYTES
    crossed: bool | None = None
    leftovers: int = 0  # processes of the job killed after mpiexec ended
    hosts: dict[str, str] = field(default_factory=dict)  # address -> hostname (mpiexec's
    # messages name nodes by address)
    warning: str = ""

    @property
    def link_bytes(self) -> int:
        """Bytes sent on all links together."""
        return sum(self.sent.values())

    @property
    def between_nodes(self) -> int:
        """Bytes the nodes sent each other (all links, less what went to the launcher)."""
        return max(0, self.link_bytes - self.to_launcher)

    def report(self) -> str:
        """A few lines for people: the job, then every node's bytes, then the warning."""
        used = sum(1 for k in self.ranks_per_node if k)
        status = ("ran past its timeout" if self.returncode is None
                  else f"exit status {self.returncode}")
        layout = "+".join(str(k) for k in self.ranks_per_node)
        lines = [f"{sum(self.ranks_per_node)} ranks on {used} node{'s' * (used != 1)} "
                 f"({layout}), {self.seconds:.1f} s, {status}"]
        for host in self.sent:
            lines.append(f"  {host}: sent {_size(self.sent[host])} on its link, received "
                         f"{_size(self.received[host])}, loopback {_size(self.loopback[host])}")
        if len(self.sent) > 1:
            lines.append(f"  between the nodes: {_size(self.between_nodes)} (to the launcher: "
                         f"{_size(self.to_launcher)})")
        if self.returncode != 0 and self.hosts:
            lines.append("  hosts: " + ", ".join(f"{a} is {h}" for a, h in self.hosts.items()))
        if self.leftovers:
            lines.append(f"  killed {self.leftovers} process(es) of the job left after mpiexec")
        if self.warning:
            lines.append(f"  WARNING: {self.warning}")
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


ETHERNET_HEADER = 14  # bytes a veth's transmit counter adds to each frame the bridge counts
MIN_RATE, MAX_RATE = 1e3, 1e12  # bytes per second tc's token bucket takes here (8 kbit, 8 tbit)


def parse_rate(rate: str) -> float:
    """Bytes per second of a ``tc`` rate (``1gbit``, ``500mbit``, ``10gbit``, ``125mbps``).
    Raises ValueError for anything else."""
    m = _RATE.match(str(rate).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r} is not valid: expected a positive number followed "
                         f"by one of {', '.join(_RATE_UNITS)} (e.g. 1gbit)")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if not MIN_RATE <= value <= MAX_RATE:
        raise ValueError(f"link rate {rate!r} is out of range: from 8kbit to 8tbit")
    return value


def parse_sizes(spec: Sequence[int] | str) -> list[int]:
    """Node sizes from ``[2, 1]``, ``"2,1"`` or ``"2x2"`` (two nodes of two ranks). Raises
    ValueError unless there are 1 to 64 nodes of at least one rank each."""
    try:
        if isinstance(spec, str):
            text = spec.strip().lower()
            if "x" in text:
                count, per = text.split("x", 1)
                sizes = [int(per)] * int(count)
            else:
                sizes = [int(s) for s in text.split(",") if s.strip()]
        else:
            sizes = [int(s) for s in spec]
    except (TypeError, ValueError):
        raise ValueError(f"nodes {spec!r} is not valid: expected node sizes such as 2,1 or "
                         f"2x2") from None
    if not 1 <= len(sizes) <= 64 or min(sizes) < 1:
        raise ValueError(f"nodes {spec!r} is not valid: 1 to 64 nodes of at least one rank each")
    return sizes


def _check_name(name: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name or ""):
        raise ValueError(f"cluster name {name!r} is not valid: 1 to 8 lowercase letters and "
                         "digits, starting with a letter")
    return name


def _cmd(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run one system command; ClusterError with its output when it fails and ``check``."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        if not check:
            return subprocess.CompletedProcess(list(args), 127, "", str(e))
        raise ClusterError(f"`{shlex.join(args)}` could not run: {e}") from None
    if check and done.returncode != 0:
        raise ClusterError(f"`{shlex.join(args)}` failed (exit status {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why this machine cannot run a virtual cluster, or None when it can. Checks the platform,
    root, the tools, then creates and removes a probe namespace with a veth pair and a ``tbf``
    qdisc (a container may refuse any of them)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root (creating network namespaces, links and qdiscs)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"missing {', '.join(missing)}: install iproute2 (ip, tc) and util-linux "
                "(unshare, nsenter)")
    probe = f"hlp{os.getpid() % 100000}"
    steps = [("ip", "netns", "add", probe),
             ("ip", "link", "add", f"{probe}a", "type", "veth", "peer", "name", NIC, "netns",
              probe),
             ("tc", "-n", probe, "qdisc", "add", "dev", NIC, "root", "tbf", "rate", "1gbit",
              "burst", "64kb", "latency", "50ms")]
    try:
        for step in steps:
            done = _cmd(*step, check=False)
            if done.returncode != 0:
                return (f"the kernel refused `{shlex.join(step)}`: "
                        f"{(done.stderr or done.stdout).strip()}")
    finally:
        _cmd("ip", "link", "del", f"{probe}a", check=False)
        _cmd("ip", "netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serializes up/down of all clusters on this machine (subnets are chosen under it)."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _netns_pids(netns: str) -> list[int]:
    done = _cmd("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()] if done.returncode == 0 else []


def _kill_pids(pids: Sequence[int], grace: float = 3.0) -> None:
    """SIGTERM, up to ``grace`` seconds, then SIGKILL to whatever of ``pids`` still runs."""
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    for p in alive:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:][:1] != b"Z"


def _find_mpiexec(mpiexec: str | None) -> list[str]:
    """The Hydra mpiexec to launch with: ``mpiexec``, $MPIEXEC, the one next to this Python, or
    PATH's. ClusterError unless it is MPICH's Hydra."""
    candidates = [mpiexec, os.environ.get("MPIEXEC"),
                  str(Path(sys.executable).with_name("mpiexec")), shutil.which("mpiexec")]
    for cand in candidates:
        if not cand:
            continue
        cmd = shlex.split(cand)
        if not (shutil.which(cmd[0]) or os.access(cmd[0], os.X_OK)):
            if cand == mpiexec:
                raise ClusterError(f"mpiexec {mpiexec!r} not found")
            continue
        version = _cmd(*cmd, "--version", check=False, timeout=30)
        if "HYDRA" not in version.stdout:
            raise ClusterError(f"the cluster launches with MPICH's Hydra mpiexec; {cand} is not "
                               "one (Open MPI: see docs/multinode.md)")
        return cmd
    raise ClusterError("no mpiexec found (pass --mpiexec, set MPIEXEC, or install the mpich "
                       "extra)")


def _clean_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` without the variables of an enclosing MPI job (a Hydra proxy started by the
    cluster's launcher would otherwise take the enclosing job's ``HYDI_CONTROL_FD`` for its
    own connection to ``mpiexec``)."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                "OMPI_")
    return {k: v for k, v in base.items() if not k.startswith(prefixes)}


def _remove_orphans() -> None:
    """Remove the temporary clusters whose owning process has ended (call under the lock)."""
    for path in STATE_ROOT.glob("*/cluster.json"):
        try:
            state = json.loads(path.read_text())
            pid, started = state.get("owner") or (None, None)
        except (OSError, ValueError, TypeError):
            continue
        if pid is None:
            continue
        alive = _reaper._start_time(int(pid))
        if alive is None or alive.decode() != started:
            VirtualCluster((1,), name=path.parent.name)._remove()


class VirtualCluster:
    """Nodes of the given sizes (``nodes=[2, 1]``: node1 runs 2 ranks by default, node2 one) on
    links limited to ``rate`` (``tc`` syntax). See the module docstring for what a node is.

    ``with VirtualCluster(nodes=[2, 2], rate="1gbit") as c:`` creates the nodes (:meth:`up`) and
    removes them on exit (:meth:`down`); ``c.run(cmd)`` runs ``cmd`` on every rank under
    ``mpiexec`` and returns a :class:`JobResult` with the bytes each node sent on its link.
    :meth:`existing` attaches to a cluster created earlier (by the command line). Clusters of
    different ``name`` coexist. Raises :class:`ClusterUnavailable` on :meth:`up` where the
    machine cannot run one (:func:`unavailable_reason`).
    """

    def __init__(self, nodes: Sequence[int] | str = (2, 2), rate: str = "1gbit",
                 name: str = DEFAULT_NAME, mpiexec: str | None = None) -> None:
        self.name = _check_name(name)
        self.sizes = parse_sizes(nodes)
        parse_rate(rate)
        self.rate = str(rate).strip().lower()
        self.mpiexec = mpiexec
        self.subnet = ""
        self.state_dir = STATE_ROOT / self.name
        self.bridge = f"{self.name}-br"
        self.owner: list | None = None  # [pid, start time] of the process a temporary cluster
        # belongs to (see up)

    # ------------------------------------------------------------------ layout and state

    @property
    def nodes(self) -> list[Node]:
        """The nodes, node1 first (addresses known once the cluster is up)."""
        return [Node(i, f"node{i}", f"{self.subnet}.{i}" if self.subnet else "",
                     f"{self.name}-n{i}", f"{self.name}-h{i}", k)
                for i, k in enumerate(self.sizes, start=1)]

    @property
    def agent(self) -> Path:
        return self.state_dir / "agent"

    def _uts(self, node: Node) -> Path:
        return self.state_dir / "uts" / node.hostname

    def _state(self) -> dict:
        return {"name": self.name, "sizes": self.sizes, "rate": self.rate, "subnet": self.subnet,
                "bridge": self.bridge, "owner": self.owner}

    @classmethod
    def existing(cls, name: str = DEFAULT_NAME, mpiexec: str | None = None) -> VirtualCluster:
        """The cluster ``name`` created earlier; ClusterError when it is not up."""
        path = STATE_ROOT / _check_name(name) / "cluster.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ClusterError(f"no cluster {name!r} is up (run `python -m "
                               "heatlike.testing.cluster up` first)") from None
        c = cls(state["sizes"], state["rate"], name, mpiexec)
        c.subnet = state["subnet"]
        c.owner = state.get("owner")
        if not c.is_up():
            raise ClusterError(f"cluster {name!r} is incomplete (its namespaces or bridge are "
                               "gone): run `down` then `up`")
        return c

    def is_up(self) -> bool:
        """Whether the bridge and every node's namespace exist."""
        if not self.subnet or not Path(f"/sys/class/net/{self.bridge}").exists():
            return False
        return all(Path(f"/run/netns/{n.netns}").exists() for n in self.nodes)

    def _free_subnet(self) -> str:
        used = set()
        for state in STATE_ROOT.glob("*/cluster.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                used.add(json.loads(state.read_text())["subnet"])
        addrs = _cmd("ip", "-o", "addr", "show", check=False).stdout
        for k in range(256):
            subnet = f"{SUBNET_PREFIX}.{k}"
            if subnet not in used and f" {subnet}." not in addrs:
                return subnet
        raise ClusterError(f"no free subnet left in {SUBNET_PREFIX}.0.0/16")

    # ------------------------------------------------------------------ up / down

    def up(self, temporary: bool = False) -> VirtualCluster:
        """Create the nodes. Idempotent: a cluster of this name with the same sizes is kept (its
        rate set to ``rate``); one with other sizes, or incomplete, is removed and created again.
        On any failure everything created so far is removed and ClusterError (or
        ClusterUnavailable) raised.

        A ``temporary`` cluster (the context manager's) belongs to this process: should the
        process die without :meth:`down` (SIGKILL), the next ``up`` of any cluster on the
        machine removes it. Clusters created on the command line stay until ``down``."""
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(f"virtual cluster unavailable: {reason}")
        if temporary:
            self.owner = [os.getpid(), (_reaper._start_time(os.getpid()) or b"").decode()]
        with _locked():
            _remove_orphans()
            parse_rate(self.rate)  # before anything is changed
            try:
                old = VirtualCluster.existing(self.name)
            except ClusterError:  # none, or incomplete: created again
                old = None
            if old is not None and old.sizes == self.sizes:
                self.subnet = old.subnet
                self.set_rate(self.rate)  # also records the owner
                return self
            if old is not None:
                busy = sum(len(_netns_pids(n.netns)) for n in old.nodes)
                if busy:
                    raise ClusterError(
                        f"cluster {self.name!r} ({','.join(map(str, old.sizes))}) has {busy} "
                        f"process(es) running on its nodes: recreating it with nodes "
                        f"{','.join(map(str, self.sizes))} would end them. Take it down first "
                        f"(down), or use another --name")
            self._remove()
            try:
                self._create()
            except BaseException:
                self._remove()
                raise
        return self

    def _create(self) -> None:
        self.subnet = self._free_subnet()
        (self.state_dir / "uts").mkdir(parents=True, exist_ok=True)
        _cmd("ip", "link", "add", self.bridge, "type", "bridge")
        _cmd("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _cmd("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{n.address} {n.hostname}\n" for n in self.nodes)
        for n in self.nodes:
            _cmd("ip", "netns", "add", n.netns)
            _cmd("ip", "link", "add", n.host_link, "type", "veth", "peer", "name", NIC, "netns",
                 n.netns)
            _cmd("ip", "link", "set", n.host_link, "master", self.bridge)
            _cmd("ip", "link", "set", n.host_link, "up")
            _cmd("ip", "-n", n.netns, "addr", "add", f"{n.address}/24", "dev", NIC)
            _cmd("ip", "-n", n.netns, "link", "set", NIC, "up")
            _cmd("ip", "-n", n.netns, "link", "set", "lo", "up")
            # IPv4 only: no neighbour discovery chatter on the links between jobs
            _cmd("ip", "netns", "exec", n.netns, "sysctl", "-q", "-w",
                 "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
                 check=False)
            self._shape(n, "add")
            # one UTS namespace per node, kept by a bind mount: every process of the node has
            # its hostname
            uts = self._uts(n)
            uts.touch()
            _cmd("unshare", f"--uts={uts}", "hostname", n.hostname)
            # `ip netns exec` shows /etc/netns/<ns>/hosts as the node's /etc/hosts
            etc = Path("/etc/netns") / n.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
        self._write_agent()
        (self.state_dir / "cluster.json").write_text(json.dumps(self._state(), indent=1))

    def _shape(self, node: Node, verb: str) -> None:
        """Limit the node's egress to the link rate: a token bucket that holds about a
        millisecond of traffic (at least 64 KiB)."""
        burst = max(64 * 1024, int(parse_rate(self.rate) / 1000))
        _cmd("tc", "-n", node.netns, "qdisc", verb, "dev", NIC, "root", "tbf", "rate", self.rate,
             "burst", str(burst), "latency", "100ms")

    def set_rate(self, rate: str) -> None:
        """Change every link's rate (no need to recreate the nodes)."""
        parse_rate(rate)
        self.rate = str(rate).strip().lower()
        for n in self.nodes:
            self._shape(n, "replace")
        (self.state_dir / "cluster.json").write_text(json.dumps(self._state(), indent=1))

    def set_link(self, node: int | str, up: bool) -> None:
        """Take a node's link down (or bring it back up), as a failing cable would."""
        n = self._node(node)
        _cmd("ip", "-n", n.netns, "link", "set", NIC, "up" if up else "down")

    def _node(self, node: int | str) -> Node:
        for n in self.nodes:
            if node in (n.index, n.hostname, str(n.index), n.address):
                return n
        raise ValueError(f"no node {node!r} in cluster {self.name!r} "
                         f"({', '.join(n.hostname for n in self.nodes)})")

    def _write_agent(self) -> None:
        """The launcher Hydra calls as ``agent [OPTIONS] HOST COMMAND...``: it runs COMMAND
        (joined by spaces, as a remote shell would) in the node whose address or name is HOST,
        within the node's network and UTS namespaces."""
        cases = "".join(
            f"  {n.address}|{n.hostname}) ns={n.netns} uts={shlex.quote(str(self._uts(n)))} ;;\n"
            for n in self.nodes)
        self.agent.write_text(
            "#!/bin/sh\n"
            f"# Launcher of the heatlike virtual cluster {self.name!r} (heatlike.testing.cluster)"
            "\nwhile [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done\n"
            "host=$1; shift\n"
            "case $host in\n"
            f"{cases}"
            f"  *) echo \"heatlike cluster {self.name}: no node $host\" >&2; exit 255 ;;\n"
            "esac\n"
            'exec ip netns exec "$ns" nsenter --uts="$uts" -- /bin/sh -c "$*"\n')
        self.agent.chmod(0o755)

    def down(self) -> None:
        """Kill every process in the nodes, remove namespaces, links, bridge, mounts and files.
        Idempotent; also removes the pieces of a cluster of this name whose state was lost."""
        with _locked():
            self._remove()

    def _remove(self) -> None:
        name = re.escape(self.name)
        netns = [line.split()[0] for line in
                 _cmd("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]
        netns = [ns for ns in netns if re.fullmatch(f"{name}-n[0-9]+", ns)]
        pids = sorted({p for ns in netns for p in _netns_pids(ns)})
        for pidfile in (self.state_dir / "slurm").glob("*.pid"):  # munged, slurmctld
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().split()[0])
                if _running(pid):
                    pids.append(pid)
        if pids:
            _kill_pids(pids)
        for ns in netns:
            _cmd("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        links = _cmd("ip", "-o", "link", "show", check=False).stdout
        for link in re.findall(rf"^\d+: ({name}-(?:h[0-9]+|br))[@:]", links, flags=re.M):
            _cmd("ip", "link", "del", link, check=False)
        with contextlib.suppress(OSError):
            mounts = Path("/proc/mounts").read_text().splitlines()
            for line in mounts:
                target = line.split()[1]
                if target.startswith(f"{self.state_dir}/"):
                    _cmd("umount", "-l", target, check=False)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only when empty

    def __enter__(self) -> VirtualCluster:
        return self.up(temporary=True)

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ counters

    def to_launcher(self) -> int:
        """Bytes the nodes have sent to the machine itself since ``up`` (what the bridge passed
        up to the machine's own network stack: ``mpiexec``'s control connections, ARP)."""
        stats = Path(f"/sys/class/net/{self.bridge}/statistics")
        try:
            # the bridge counts frames without their 14-byte Ethernet header, which the nodes'
            # own transmit counters include
            return int((stats / "rx_bytes").read_text()) + \
                ETHERNET_HEADER * int((stats / "rx_packets").read_text())
        except (OSError, ValueError):
            raise ClusterError(f"cluster {self.name!r} has no bridge {self.bridge}") from None

    def traffic(self) -> dict[str, LinkCounters]:
        """Every node's counters now (bytes since ``up``), by hostname."""
        out = {}
        for n in self.nodes:
            links = json.loads(_cmd("ip", "-n", n.netns, "-s", "-j", "link", "show").stdout)
            stats = {link["ifname"]: link.get("stats64", {}) for link in links}
            nic, lo = stats.get(NIC, {}), stats.get("lo", {})
            out[n.hostname] = LinkCounters(nic.get("tx", {}).get("bytes", 0),
                                           nic.get("rx", {}).get("bytes", 0),
                                           lo.get("tx", {}).get("bytes", 0))
        return out

    # ------------------------------------------------------------------ jobs

    def placement(self, ranks_per_node: int | Sequence[int] | None = None,
                  n: int | None = None) -> list[int]:
        """Ranks on each node: ``ranks_per_node`` (one number for every node, or one per node,
        0 to leave a node out), or ``n`` ranks filling the nodes in order up to their sizes, or
        the node sizes. ValueError for an impossible request."""
        if ranks_per_node is not None and n is not None:
            raise ValueError("give ranks_per_node or n, not both")
        if n is not None:
            if not 1 <= n <= sum(self.sizes):
                raise ValueError(f"{n} ranks do not fit on nodes of sizes {self.sizes} (1 to "
                                 f"{sum(self.sizes)}; or give ranks_per_node)")
            out, left = [], n
            for k in self.sizes:
                out.append(min(k, left))
                left -= out[-1]
            return out
        if ranks_per_node is None:
            return list(self.sizes)
        if isinstance(ranks_per_node, int):
            out = [ranks_per_node] * len(self.sizes)
        else:
            out = [int(k) for k in ranks_per_node]
            out += [0] * (len(self.sizes) - len(out))
        if len(out) != len(self.sizes) or min(out) < 0 or sum(out) < 1:
            raise ValueError(f"ranks_per_node {ranks_per_node!r} does not fit {len(self.sizes)} "
                             "nodes (one count >= 0 per node, at least one rank in all)")
        return out

    def command(self, ranks_per_node: int | Sequence[int] | None = None, n: int | None = None,
                mpiexec: str | None = None) -> list[str]:
        """The ``mpiexec`` command line (without the program) that places ranks on the nodes
        (see :meth:`placement`)."""
        if not self.is_up():
            raise ClusterError(f"cluster {self.name!r} is not up")
        placed = self.placement(ranks_per_node, n)
        hosts = ",".join(f"{node.address}:{k}" for node, k in zip(self.nodes, placed) if k)
        return [*_find_mpiexec(mpiexec or self.mpiexec), "-launcher", "rsh", "-launcher-exec",
                str(self.agent), "-iface", self.bridge, "-hosts", hosts, "-n", str(sum(placed)),
                "-wdir", os.getcwd(), "-genvall"]

    def environment(self, base: Mapping[str, str] | None = None, tag: str | None = None,
                    transport: Mapping[str, str] = TRANSPORT_ENV) -> dict[str, str]:
        """The job's environment: ``base`` (default: this process's) without the variables of
        an enclosing MPI job and the layout overrides, with the ``transport`` settings (default
        :data:`TRANSPORT_ENV`, which keeps inter-node traffic on the links), the cluster's name
        (``HEATLIKE_CLUSTER``) and the job's tag."""
        env = _clean_env(os.environ if base is None else base)
        for key in LAYOUT_ENV:
            env.pop(key, None)
        env.update(transport)
        env["HEATLIKE_CLUSTER"] = self.name
        if tag:
            env[JOB_TAG] = tag
        return env

    def kill_job(self, tag: str) -> int:
        """Kill every process still carrying the job's tag (SIGKILL); how many there were."""
        return _reaper.sweep(tag)

    def _measure(self, before: Mapping[str, LinkCounters], launcher: int,
                 result: JobResult) -> None:
        """Fill in ``result``'s bytes from the counters before the job (``before``, and
        ``launcher``: :meth:`to_launcher`) and now, and judge whether a job on several nodes
        crossed the links."""
        after = self.traffic()
        result.to_launcher = self.to_launcher() - launcher
        for host, b in before.items():
            a = after[host]
            result.sent[host] = a.tx - b.tx
            result.received[host] = a.rx - b.rx
            result.loopback[host] = a.lo_tx - b.lo_tx
        used = sum(1 for k in result.ranks_per_node if k)
        if used > 1:
            result.crossed = result.between_nodes >= result.min_bytes
            if not result.crossed and result.returncode == 0:
                result.warning = (
                    f"the job ran on {used} nodes but its nodes sent each other only "
                    f"{_size(result.between_nodes)} (less than {_size(result.min_bytes)}): its "
                    "ranks did not talk "
                    "over the network (a shared-memory transport between the namespaces?); a "
                    "timing of it says nothing about the links")

    @contextlib.contextmanager
    def job(self, ranks_per_node: int | Sequence[int] | None = None, *, n: int | None = None,
            env: Mapping[str, str] | None = None, min_bytes: int = MIN_BYTES,
            mpiexec: str | None = None,
            transport: Mapping[str, str] = TRANSPORT_ENV) -> Iterator[Job]:
        """The frame of one job, for callers that start and end ``mpiexec`` themselves (the test
        matrix; :meth:`run` uses it too). Yields a :class:`Job` whose ``command`` (the
        ``mpiexec`` prefix, see :meth:`command`) and ``env`` (see :meth:`environment`, with a new
        tag and ``HEATLIKE_CLUSTER_RANKS``, the ranks on each node: ``2,1``) the caller
        launches with; the caller ends its ``mpiexec`` before leaving the block
        and sets ``job.result.returncode``. Within the block a reaper ends the job if this
        process dies; on leaving it every process left with the job's tag is killed
        (``result.leftovers``) and the bytes each node sent during the block are filled in."""
        placed = self.placement(ranks_per_node, n)
        tag = uuid.uuid4().hex
        result = JobResult(self.command(placed, mpiexec=mpiexec), None, 0.0, placed,
                           min_bytes=min_bytes,
                           hosts={node.address: node.hostname for node in self.nodes})
        job = Job(result.command, self.environment(env, tag, transport), tag, result)
        job.env["HEATLIKE_CLUSTER_RANKS"] = ",".join(str(k) for k in placed)
        before, launcher = self.traffic(), self.to_launcher()
        reaper = None
        try:
            from .children import held_signals, start

            with held_signals():
                reaper = start([sys.executable, "-I", "-S", _reaper.__file__, str(os.getpid()),
                                tag], env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            yield job
        finally:
            result.leftovers = self.kill_job(tag)
            if reaper is not None:
                with contextlib.suppress(OSError):
                    reaper.kill()
                reaper.wait()
        self._measure(before, launcher, result)

    def run(self, cmd: Sequence[str], ranks_per_node: int | Sequence[int] | None = None, *,
            n: int | None = None, env: Mapping[str, str] | None = None,
            timeout: float | None = None, require_traffic: bool = False,
            min_bytes: int = MIN_BYTES, mpiexec: str | None = None,
            transport: Mapping[str, str] = TRANSPORT_ENV, **popen) -> JobResult:
        """Run ``cmd`` on the nodes (see :meth:`placement`) and wait for it; ``popen`` goes to
        ``subprocess.Popen`` (``stdout=``, ``stderr=``); ``env`` and ``transport`` go to
        :meth:`environment`. After ``timeout`` seconds the job is ended (``returncode`` None).
        Whatever happens, including a stop signal turned into an exception, nothing of the job
        outlives this call (see :meth:`job`). With ``require_traffic``, a job on several nodes
        that moved less than ``min_bytes`` raises :class:`TrafficError`."""
        from .children import Stopped, end_tree, held_signals, start

        with self.job(ranks_per_node, n=n, env=env, min_bytes=min_bytes, mpiexec=mpiexec,
                      transport=transport) as job:
            result = job.result
            result.command = [*job.command, *cmd]
            t0 = time.monotonic()
            proc = None
            try:
                with held_signals():
                    proc = start(result.command, env=job.env, **popen)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    result.returncode = proc.wait(timeout=timeout)
            finally:
                result.seconds = time.monotonic() - t0
                if proc is not None:
                    try:
                        end_tree(proc)
                    except Stopped:  # arrived during the clean-up: finish it, then stop
                        end_tree(proc)
                        raise
        if require_traffic and result.crossed is False:
            raise TrafficError(result.warning, result)
        return result

    def status(self) -> str:
        """A few lines: the nodes, their addresses, sizes, link state, processes, counters."""
        lines = [f"cluster {self.name}: {len(self.sizes)} nodes, links at {self.rate}, bridge "
                 f"{self.bridge} ({self.subnet}.254)"]
        counters = self.traffic()
        for n in self.nodes:
            state = json.loads(_cmd("ip", "-n", n.netns, "-j", "link", "show", "dev",
                                    NIC).stdout)[0].get("operstate", "?")
            c = counters[n.hostname]
            lines.append(f"  {n.hostname} {n.address} ({n.slots} rank{'s' * (n.slots != 1)}): "
                         f"link {state.lower()}, {len(_netns_pids(n.netns))} processes, sent "
                         f"{_size(c.tx)}, received {_size(c.rx)}, loopback {_size(c.lo_tx)}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- command line


def _all_names() -> list[str]:
    names = {p.parent.name for p in STATE_ROOT.glob("*/cluster.json")}
    for line in _cmd("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.fullmatch(r"([a-z][a-z0-9]{0,7})-n[0-9]+", line.split()[0] if line.strip() else "")
        # (a namespace of that pattern is a cluster's only with the cluster's bridge beside it)
        if m and Path(f"/sys/class/net/{m.group(1)}-br").exists():
            names.add(m.group(1))
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m heatlike.testing.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=DEFAULT_NAME, help=f"the cluster (default {DEFAULT_NAME})")
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="create the nodes")
    up.add_argument("--nodes", default="2,2", help="node sizes: 2,1 or 2x2 (default 2,2)")
    up.add_argument("--rate", default="1gbit", help="link rate, tc syntax (default 1gbit)")
    run = sub.add_parser("run", help="run `-- CMD...` on the nodes under mpiexec")
    where = run.add_mutually_exclusive_group()
    where.add_argument("-n", type=int, help="ranks, filling the nodes in order")
    where.add_argument("--ranks-per-node", help="K for every node, or K1,K2,... (0: unused)")
    run.add_argument("--require-traffic", action="store_true",
                     help="exit with status 3 when the nodes of a job on several nodes sent "
                          "each other less than --min-bytes")
    run.add_argument("--min-bytes", type=int, default=MIN_BYTES,
                     help=f"(default {MIN_BYTES})")
    run.add_argument("--timeout", type=float, default=None, help="end the job after S seconds")
    run.add_argument("--json", help="write the job's result (bytes per node) to this file")
    run.add_argument("--mpiexec", default=None, help="Hydra mpiexec (default: the venv's)")
    sub.add_parser("traffic", help="bytes each node sent and received since up")
    sub.add_parser("status", help="nodes, links, processes, counters")
    sub.add_parser("check", help="say whether this machine can run the cluster")
    rate = sub.add_parser("rate", help="change the link rate")
    rate.add_argument("rate")
    link = sub.add_parser("link", help="take a node's link down or up")
    link.add_argument("node")
    link.add_argument("state", choices=["up", "down"])
    slurm = sub.add_parser("slurm", help="a real SLURM on the nodes (heatlike.testing.slurm)")
    slurm.add_argument("verb", choices=["up", "down", "status", "env", "sbatch"],
                       help="up: start it; env: the shell lines that point sbatch, srun and "
                            "sinfo at it; sbatch -- [OPTIONS] SCRIPT: submit, wait, report "
                            "the job and its bytes between the nodes")
    slurm.add_argument("--cpus", type=int, default=16, help="CPUs of every node (default 16)")
    slurm.add_argument("--timeout", type=float, default=600,
                       help="sbatch: cancel the job after S seconds (default 600)")
    down = sub.add_parser("down", help="remove the cluster")
    down.add_argument("--all", action="store_true", help="every heatlike cluster on this machine")
    opts = p.parse_args(argv)
    if cmd and opts.action not in ("run", "slurm"):
        p.error("`-- CMD` goes with run and slurm sbatch only")
    prefix = f"heatlike cluster {opts.name}:"
    try:
        if opts.action == "check":
            reason = unavailable_reason()
            print(f"{prefix} {'unavailable: ' + reason if reason else 'this machine can run it'}")
            return 2 if reason else 0
        if opts.action == "up":
            c = VirtualCluster(opts.nodes, opts.rate, opts.name).up()
            nodes = ", ".join(f"{n.hostname} {n.address} ({n.slots})" for n in c.nodes)
            print(f"{prefix} up: {nodes}; links at {c.rate}")
            return 0
        if opts.action == "down":
            for name in (_all_names() if opts.all else [opts.name]):
                VirtualCluster((1,), name=name).down()
                print(f"heatlike cluster {name}: removed")
            return 0
        c = VirtualCluster.existing(opts.name)
        if opts.action == "traffic":
            for host, t in c.traffic().items():
                print(f"{host} link_tx_bytes={t.tx} link_rx_bytes={t.rx} lo_tx_bytes={t.lo_tx}")
            print(f"to_launcher_bytes={c.to_launcher()}")
            return 0
        if opts.action == "status":
            print(c.status())
            return 0
        if opts.action == "rate":
            c.set_rate(opts.rate)
            print(f"{prefix} links at {c.rate}")
            return 0
        if opts.action == "link":
            c.set_link(opts.node, opts.state == "up")
            return 0
        if opts.action == "slurm":
            return _slurm(c, opts, cmd, prefix)
        return _run(c, opts, cmd, prefix)
    except (ClusterError, ValueError) as e:
        print(f"{prefix} {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the state directory (its lock) cannot be made or opened
        print(f"{prefix} {e.strerror or e}: {e.filename or STATE_ROOT} (run as root; "
              f"HEATLIKE_CLUSTER_STATE names another state directory)", file=sys.stderr)
        return 2


def _slurm(c: VirtualCluster, opts: argparse.Namespace, cmd: list[str], prefix: str) -> int:
    from .slurm import Slurm

    s = Slurm(c, cpus=opts.cpus)
    if opts.verb == "up":
        s.up()
        print(f"{prefix} {s.status()}\n{prefix} for sbatch, srun and sinfo: "
              f"export SLURM_CONF={s.conf}")
    elif opts.verb == "down":
        s.down()
        print(f"{prefix} SLURM stopped")
    elif opts.verb == "status":
        print(s.status())
    elif opts.verb == "env":
        for key, value in s.environment({}).items():
            print(f"export {key}={shlex.quote(value)}")
    else:
        if not cmd:
            raise ValueError("slurm sbatch: give `-- [SBATCH OPTIONS] SCRIPT`")
        result = s.sbatch(cmd[-1], cmd[:-1], timeout=opts.timeout)
        print(result.output, end="")
        print(f"{prefix} {result.report()}", file=sys.stderr)
        return 0 if result.state == "COMPLETED" else (result.exit_code or 1)
    return 0


def _run(c: VirtualCluster, opts: argparse.Namespace, cmd: list[str], prefix: str) -> int:
    from .children import Stopped, stop_on_signals

    if not cmd:
        raise ValueError("run: give the command after --")
    if opts.timeout is not None and not opts.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {opts.timeout}")
    if opts.min_bytes < 0:
        raise ValueError(f"--min-bytes must be >= 0, got {opts.min_bytes}")
    if opts.json:  # checked before the job runs: its result would be lost after
        target = Path(opts.json)
        if not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
            raise ValueError(f"--json {opts.json}: cannot write a file in {target.parent}")
    per_node = opts.ranks_per_node
    if per_node is not None:
        try:
            per_node = ([int(k) for k in per_node.split(",")] if "," in per_node
                        else int(per_node))
        except ValueError:
            raise ValueError(f"--ranks-per-node {opts.ranks_per_node!r} is not valid: give K or "
                             "K1,K2,...") from None
    dropped = [k for k in LAYOUT_ENV if k in os.environ]
    if dropped:
        print(f"{prefix} not passing {', '.join(dropped)} to the job: the ranks find their real "
              "nodes", file=sys.stderr)
    try:
        with stop_on_signals():
            result = c.run(cmd, per_node, n=opts.n, timeout=opts.timeout,
                           min_bytes=opts.min_bytes, mpiexec=opts.mpiexec)
    except Stopped as stop:
        print(f"{prefix} stopped by {stop.name}; the job's processes on every node were ended",
              file=sys.stderr)
        return 128 + stop.signum
    print(f"{prefix} {result.report()}", file=sys.stderr)
    if opts.json:
        Path(opts.json).write_text(json.dumps({**asdict(result), "link_bytes": result.link_bytes,
                                               "between_nodes": result.between_nodes}, indent=1))
    if result.returncode is None:
        return 124
    if result.returncode != 0:
        return result.returncode
    if opts.require_traffic and result.crossed is False:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
