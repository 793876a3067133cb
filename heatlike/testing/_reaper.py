"""Kill the processes of one virtual-cluster job, found by the tag in their environment.

A job started by :meth:`heatlike.testing.cluster.VirtualCluster.run` carries
``HEATLIKE_CLUSTER_JOB=<tag>`` in the environment of every process it starts, on every node
(``mpiexec``, the node proxies, the ranks and whatever they start, even in a session of their
own). :func:`sweep` kills them all.

Run as a script (``python -I -S _reaper.py RUNNER_PID TAG``; the standard library only, so it
starts in milliseconds), it is the job's reaper: it waits until the process ``RUNNER_PID`` ends,
or until it receives SIGTERM, SIGINT or SIGHUP, then sweeps. The runner starts it next to the
job and kills it once it has cleaned up itself, so the job is ended even when the runner is
killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

TAG_VARIABLE = "HEATLIKE_CLUSTER_JOB"


def _start_time(pid: int) -> bytes | None:
    """The start time of a living (not zombie) process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return None if fields[0] == b"Z" else fields[19]


def tagged(tag: str) -> list[int]:
    """The living processes (other than this one) whose environment holds the job's tag."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and _start_time(int(name)) is not None:
            found.append(int(name))
    return found


def sweep(tag: str, rounds: int = 5) -> int:
    """SIGKILL every process of the job, again until none is left (a process may start another
    while the sweep runs) or ``rounds`` sweeps were made; how many were killed."""
    killed: set[int] = set()
    for _ in range(rounds):
        pids = [p for p in tagged(tag) if p not in killed]
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except OSError:
                continue  # it ended between the scan and the kill
        time.sleep(0.05)
    return len(killed)


def _watch(runner: int, tag: str) -> None:
    def stop(_signum, _frame):
        raise SystemExit(0)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop)
    started = _start_time(runner)
    with contextlib.suppress(SystemExit):  # a signal ends the wait: sweep now
        while started is not None and _start_time(runner) == started:
            time.sleep(0.5)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    sweep(tag)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2])
