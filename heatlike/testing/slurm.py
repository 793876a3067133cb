"""A real SLURM on the nodes of a virtual cluster (:mod:`heatlike.testing.cluster`): batch scripts
run through the scheduler users have, on nodes whose traffic crosses rate-limited links.

    python -m heatlike.testing.cluster [--name hlc] slurm up [--cpus 16]
    python -m heatlike.testing.cluster slurm sbatch [--timeout S] -- [SBATCH OPTIONS] SCRIPT
    python -m heatlike.testing.cluster slurm env | status | down

What runs where. ``munged`` (a private key and socket under the cluster's state directory) and
``slurmctld`` run on the machine, the controller listening on the bridge's address; one
``slurmd -N node<i>`` runs inside each node's network and UTS namespaces, so the job steps it
starts (``srun``'s tasks, through ``slurmstepd``) live on that node: they have its hostname and
talk to the other nodes over its link. The configuration (``slurm.conf`` under the state
directory, found by the clients through ``SLURM_CONF``) makes every node a ``--cpus`` CPU machine
(``SlurmdParameters=config_overrides``: the scripts' ``--cpus-per-task`` and
``--ntasks-per-node`` are honoured as written, on oversubscribed cores), one partition
``batch``, ``MpiDefault=pmi2`` (``srun`` starts the MPICH wheel's ranks through PMI-2), no
process tracking by cgroups (``proctrack/linuxproc``, ``task/none``). slurmd 22.05 loads a cgroup
plugin whatever the configuration says; it gets a private v1 ``freezer`` hierarchy mounted in the
node's own mount namespace.

Jobs get the environment of :meth:`Slurm.environment`: the cluster's transport settings (the
inter-node traffic stays on the links, see :mod:`heatlike.testing.cluster`), no layout override,
no variable of an enclosing SLURM job or MPI launcher, and ``SLURM_CONF``. :meth:`Slurm.sbatch`
submits a script with ``sbatch --wait`` and returns a :class:`BatchResult`: the job's state,
exit code, node list, output and the bytes the nodes sent each other meanwhile
(:meth:`Slurm.submit`, :meth:`Slurm.signal` and :meth:`Slurm.wait` do it in steps).

``slurm down`` stops the daemons, the job steps and the jobs' processes (found by the
``SLURM_CONF`` in their environment) and removes the state; other jobs on the nodes
(``VirtualCluster.run``) are left alone. The cluster's ``down`` ends everything.

Requirements: the cluster's, plus Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and
``munge`` packages (22.05 is what the settings were written for); :func:`unavailable_reason`
says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .cluster import (
    ClusterError,
    ClusterUnavailable,
    VirtualCluster,
    _kill_pids,
    _netns_pids,
    _running,
)
from .cluster import _size as size_text

__all__ = ["Slurm", "BatchResult", "unavailable_reason", "TOOLS"]

TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel", "munged")
PACKAGES = "slurmctld slurmd slurm-client munge"
_KEEP_SLURM = ("SLURM_CONF",)
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE")
REQUEUE_SETTLE_S = 3.0  # a final state seen this long apart twice has settled
REQUEUE_RELEASE_S = 3  # a requeued job may start again this many seconds after it is seen
# pending reasons of a job that asks for more than the cluster has: cancelled at once
NEVER_STARTS = ("PartitionNodeLimit", "PartitionConfig", "BadConstraints", "PartitionTimeLimit")


def unavailable_reason(cluster: VirtualCluster | None = None) -> str | None:
    """Why SLURM cannot run on the virtual cluster here, or None: the cluster's own reason
    (when no ``cluster`` is up yet), then the SLURM and munge programs."""
    if cluster is None or not cluster.is_up():
        from .cluster import unavailable_reason as cluster_reason

        reason = cluster_reason()
        if reason:
            return reason
    missing = [t for t in TOOLS if shutil.which(t) is None
               and not Path("/usr/sbin", t).exists()]
    if missing:
        return (f"missing {', '.join(missing)}: install SLURM and munge (Debian/Ubuntu: "
                f"apt-get install {PACKAGES})")
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class BatchResult:
    """One batch job submitted by :meth:`Slurm.sbatch`: its id, final ``state`` (COMPLETED,
    FAILED, TIMEOUT, ...), ``exit_code`` (of the batch script), ``nodes`` (the hostnames of its
    allocation), the text of its output file, and the bytes every node sent on its link
    while it ran (``between_nodes`` excludes what went to the machine: the controller's and
    the clients' messages)."""

    job_id: int
    state: str
    exit_code: int | None
    nodes: list[str]
    output: str
    seconds: float
    sent: dict[str, int] = field(default_factory=dict)
    to_machine: int = 0
    restarts: int = 0
    reason: str = ""  # why SLURM could never start it (then it was cancelled)

    @property
    def between_nodes(self) -> int:
        return max(0, sum(self.sent.values()) - self.to_machine)

    def report(self) -> str:
        why = f" (could never start: {self.reason})" if self.reason else ""
        return (f"job {self.job_id}: {self.state}{why}, exit code {self.exit_code}, nodes "
                f"{','.join(self.nodes) or '-'}, {self.seconds:.1f} s, "
                f"{self.restarts} restart(s); between the nodes "
                f"{size_text(self.between_nodes)}")


class Slurm:
    """SLURM on ``cluster``'s nodes (see the module docstring). ``with Slurm(c) as s:`` starts
    the daemons (:meth:`up`) and stops them on exit (:meth:`down`). Raises
    :class:`~heatlike.testing.cluster.ClusterUnavailable` from :meth:`up` where the programs are
    missing, :class:`~heatlike.testing.cluster.ClusterError` (with the log's last lines) where a
    daemon does not start."""

    def __init__(self, cluster: VirtualCluster, cpus: int = 16) -> None:
        if cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {cpus}")
        self.cluster = cluster
        self.cpus = int(cpus)
        self.dir = cluster.state_dir / "slurm"
        self._submitted: dict[int, tuple] = {}
        self._released: dict[int, str] = {}  # job id -> the restart count already let go

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def _socket(self) -> Path:
        return self.dir / "munge.socket"

    # ------------------------------------------------------------------ daemons

    def _pids(self) -> list[int]:
        pids = []
        for f in self.dir.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(f.read_text().split()[0]))
        return pids

    def is_up(self) -> bool:
        """Whether this cluster's controller answers and every node is idle or busy."""
        if not self.conf.exists():
            return False
        done = subprocess.run([_tool("sinfo"), "-h", "-N", "-o", "%N %t"], capture_output=True,
                              text=True, env=self.environment(), timeout=30, check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return done.returncode == 0 and all(
            states.get(n.hostname, "").rstrip("*") in ("idle", "alloc", "mix", "comp")
            for n in self.cluster.nodes)

    def up(self, timeout: float = 60) -> Slurm:
        """Start munge, the controller and one slurmd per node; wait until every node is idle.
        A SLURM already running on this cluster is stopped first. On failure everything
        started is stopped again."""
        reason = unavailable_reason(self.cluster)
        if reason:
            raise ClusterUnavailable(f"SLURM unavailable: {reason}")
        if not self.cluster.is_up():
            raise ClusterError(f"cluster {self.cluster.name!r} is not up")
        self.down()
        try:
            self._start(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self.dir.mkdir(parents=True)
        (self.dir / "state").mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon("munged", [_tool("munged"), "--force", f"--socket={self._socket}",
                                f"--key-file={key}", f"--pid-file={self.dir / 'munged.pid'}",
                                f"--log-file={self.dir / 'munged.log'}",
                                f"--seed-file={self.dir / 'munged.seed'}"])
        self.conf.write_text(self._config())
        # slurmd looks for cgroup.conf next to slurm.conf
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n")
        self._daemon("slurmctld", [_tool("slurmctld"), "-i", "-f", str(self.conf)])
        for n in self.cluster.nodes:
            (self.dir / f"spool-{n.hostname}").mkdir()
            script = (
                "mount -t tmpfs cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/freezer && "
                "mount -t cgroup -o freezer none /sys/fs/cgroup/freezer && "
                f"exec {shlex.quote(_tool('slurmd'))} -f {shlex.quote(str(self.conf))} "
                f"-N {n.hostname}")
            self._daemon(f"slurmd on {n.hostname}",
                         ["ip", "netns", "exec", n.netns, "nsenter",
                          f"--uts={self.cluster._uts(n)}", "--", "/bin/sh", "-c", script],
                         log=self.dir / f"slurmd-{n.hostname}.log")
        deadline = time.monotonic() + timeout
        while not self.is_up():
            if time.monotonic() > deadline:
                raise ClusterError(f"SLURM: the nodes are not idle after {timeout:.0f} s "
                                   f"(sinfo: {self._sinfo()}); logs in {self.dir}")
            time.sleep(0.5)

    def _daemon(self, what: str, argv: list[str], log: Path | None = None) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env=self.environment(), check=False)
        if done.returncode != 0:
            tail = ""
            if log is not None and log.exists():
                tail = "; log: " + " | ".join(log.read_text().splitlines()[-5:])
            raise ClusterError(f"SLURM: {what} did not start (exit status {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()}{tail}")

    def _config(self) -> str:
        """slurm.conf for this cluster (see the module docstring)."""
        d = self.dir
        host = socket.gethostname().split(".")[0]
        lines = [
            f"ClusterName=heatlike{self.cluster.name}",
            f"SlurmctldHost={host}({self.cluster.subnet}.254)",
            f"SlurmctldPort={_free_port(self.cluster.subnet + '.254')}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self._socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "MpiDefault=pmi2",
            "ReturnToService=2",
            "KillWait=5",
            "MinJobAge=600",
        ]
        lines += [f"NodeName={n.hostname} NodeAddr={n.address} CPUs={self.cpus} State=UNKNOWN"
                  for n in self.cluster.nodes]
        names = ",".join(n.hostname for n in self.cluster.nodes)
        lines.append(f"PartitionName=batch Nodes={names} Default=YES MaxTime=INFINITE State=UP "
                     "OverSubscribe=YES")
        return "\n".join(lines) + "\n"

    def down(self) -> None:
        """Stop every daemon and job of this cluster's SLURM and remove its files. Idempotent."""
        if not self.dir.exists():
            return
        pids = [p for p in self._pids() if _running(p)]
        for n in self.cluster.nodes:  # slurmd, slurmstepd and the jobs' processes, not others
            pids += [p for p in (_netns_pids(n.netns) if self.cluster.subnet else [])
                     if self._owns(p)]
        _kill_pids(sorted(set(pids)))
        shutil.rmtree(self.dir, ignore_errors=True)

    def _owns(self, pid: int) -> bool:
        """Whether process ``pid`` (in a node) is this SLURM's: a ``slurmd`` or ``slurmstepd``,
        or a job's process (its environment names this SLURM's configuration). Other jobs on
        the cluster (``VirtualCluster.run``) are left alone."""
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() in ("slurmd", "slurmstepd"):
                    return True
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f"SLURM_CONF={self.conf}".encode() in f.read().split(b"\0")
        except OSError:
            return False

    def __enter__(self) -> Slurm:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def _sinfo(self) -> str:
        done = subprocess.run([_tool("sinfo"), "-h", "-N", "-o", "%N %t %E"],
                              capture_output=True, text=True, env=self.environment(),
                              timeout=30, check=False)
        return " | ".join((done.stdout or done.stderr).strip().splitlines())

    # ------------------------------------------------------------------ jobs

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a client command or job: the cluster's (transport settings, no
        layout override, no variable of an enclosing MPI launcher), no ``SLURM_*`` of an
        enclosing job, and ``SLURM_CONF``."""
        env = self.cluster.environment(base)
        env = {k: v for k, v in env.items()
               if not (k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
                       and k not in _KEEP_SLURM)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of one job (known until MinJobAge after its end)."""
        done = subprocess.run([_tool("scontrol"), "-o", "show", "job", str(job_id)],
                              capture_output=True, text=True, env=self.environment(),
                              timeout=30, check=False)
        if done.returncode != 0:
            raise ClusterError(f"SLURM: no job {job_id}: {(done.stderr or done.stdout).strip()}")
        return dict(m.groups() for m in re.finditer(r"(\w+(?::\w+)?)=(\S*)", done.stdout))

    def log_lines(self, job_id: int, last: int = 30) -> list[str]:
        """The last ``last`` lines of the controller's and the nodes' logs that name job
        ``job_id`` (for failure reports)."""
        pattern = re.compile(rf"(JobId={job_id}\b|job[ _]?{job_id}\b|StepId={job_id}\.)",
                             re.IGNORECASE)
        lines = []
        for log in sorted(self.dir.glob("slurm*.log")):
            with contextlib.suppress(OSError):
                lines += [f"{log.name}: {line}" for line in
                          log.read_text(errors="replace").splitlines() if pattern.search(line)]
        return lines[-last:]

    def submit(self, script: str | os.PathLike, options: Sequence[str] = (), *,
               env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
               output: str | os.PathLike | None = None) -> int:
        """Submit ``script`` with ``sbatch [options]`` from ``cwd``; the job id. ``env`` is the
        submitter's environment (default: this process's; see :meth:`environment`); ``output``
        (default ``<cwd>/slurm-<script>-%j.out``) the job's output file. The link counters are
        read now, for :meth:`wait`'s bytes."""
        cwd = Path(cwd or os.getcwd())
        out = Path(output) if output else cwd / f"slurm-{Path(script).stem}-%j.out"
        before, machine = self.cluster.traffic(), self.cluster.to_launcher()
        t0 = time.monotonic()
        done = subprocess.run([_tool("sbatch"), "--parsable", f"--output={out}", *options,
                               str(script)], cwd=cwd, env=self.environment(env),
                              capture_output=True, text=True, timeout=60, check=False)
        job_id = _first_int(done.stdout) if done.returncode == 0 else None
        if job_id is None:
            raise ClusterError(f"sbatch {script} was not accepted: "
                               f"{(done.stderr or done.stdout).strip()}")
        self._submitted[job_id] = (before, machine, t0, out)
        return job_id

    def signal(self, job_id: int, signal: str = "USR1") -> None:
        """Send ``signal`` to the job's batch shell only, as ``--signal=B:<signal>@T`` does
        ``T`` seconds before the time limit (``scancel --batch --signal``)."""
        subprocess.run([_tool("scancel"), "--batch", f"--signal={signal}", str(job_id)],
                       env=self.environment(), timeout=30, check=True, capture_output=True)

    def poll(self, job_id: int, release_requeued: bool = True) -> dict[str, str]:
        """:meth:`job_info`; a requeued job that SLURM holds back (two minutes, before it may
        start again) is let go after :data:`REQUEUE_RELEASE_S` seconds when ``release_requeued``
        (``scontrol update StartTime=now+N``, once per restart), so that a requeue costs
        seconds. Not at once: slurmd refuses a credential issued in the same second as the
        revocation of the run it replaces ("Job credential revoked") and the job fails."""
        info = self.job_info(job_id)
        restarts = info.get("Restarts", "0")
        if (release_requeued and info.get("JobState") == "PENDING"
                and info.get("Reason") == "BeginTime" and restarts != "0"
                and self._released.get(job_id) != restarts):
            self._released[job_id] = restarts
            subprocess.run([_tool("scontrol"), "update", f"JobId={job_id}",
                            f"StartTime=now+{REQUEUE_RELEASE_S}"],
                           env=self.environment(), timeout=30, capture_output=True, check=False)
        return info

    def ended(self, job_id: int, release_requeued: bool = True) -> tuple[bool, dict[str, str]]:
        """``(whether the job has ended, its fields)``. A final state counts once it holds a
        second look later (with no new restart): around a requeue the controller can show one
        before the job is pending again."""
        info = self.poll(job_id, release_requeued)
        if info.get("JobState") not in FINAL_STATES:
            return False, info
        time.sleep(REQUEUE_SETTLE_S)
        again = self.poll(job_id, release_requeued)
        settled = again.get("JobState") in FINAL_STATES and \
            again.get("Restarts") == info.get("Restarts")
        return settled, again

    def wait(self, job_id: int, timeout: float = 600,
             release_requeued: bool = True) -> BatchResult:
        """Wait until the job has ended (requeues included) and return what it did. After
        ``timeout`` seconds it is cancelled (state CANCELLED), as is a job that asks for more
        than the cluster has (its ``reason`` says what, e.g. ``PartitionNodeLimit``). For
        ``release_requeued`` see :meth:`poll`."""
        before, machine, t0, out = self._submitted.pop(job_id)
        deadline = time.monotonic() + timeout
        reason = ""
        while not (found := self.ended(job_id, release_requeued))[0]:
            info = found[1]
            never = info.get("JobState") == "PENDING" and info.get("Reason") in NEVER_STARTS
            if never:
                reason = info["Reason"]
            if never or time.monotonic() > deadline:
                subprocess.run([_tool("scancel"), str(job_id)], env=self.environment(),
                               timeout=30, check=False)
                deadline = float("inf")  # wait for the cancellation to land
            time.sleep(0.5)
        info = found[1]
        seconds = time.monotonic() - t0
        after = self.cluster.traffic()
        path = Path(str(out).replace("%j", str(job_id)).replace("%x", info.get("JobName", "")))
        text = path.read_text(errors="replace") if path.exists() else ""
        code = info.get("ExitCode", "").split(":")[0]
        return BatchResult(
            job_id, info.get("JobState", "?"), int(code) if code.isdigit() else None,
            _expand(info.get("NodeList", "")), text, seconds,
            {h: after[h].tx - b.tx for h, b in before.items()},
            self.cluster.to_launcher() - machine, int(info.get("Restarts", "0") or 0), reason)

    def sbatch(self, script: str | os.PathLike, options: Sequence[str] = (), *,
               env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
               output: str | os.PathLike | None = None, timeout: float = 600) -> BatchResult:
        """:meth:`submit`, then :meth:`wait`."""
        job_id = self.submit(script, options, env=env, cwd=cwd, output=output)
        return self.wait(job_id, timeout)

    def status(self) -> str:
        if not self.conf.exists():
            return f"SLURM on cluster {self.cluster.name}: not running"
        return f"SLURM on cluster {self.cluster.name} ({self.conf}): {self._sinfo()}"


def _first_int(text: str) -> int | None:
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else None


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _expand(nodelist: str) -> list[str]:
    """``node[1-2],node4`` -> ``['node1', 'node2', 'node4']`` (SLURM's host list syntax)."""
    out: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            out.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            out += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out
