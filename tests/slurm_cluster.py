"""A real one-host Slurm cluster for the tests: munged, slurmctld and two slurmd (nodes gpu1, gpu2),
each node with two fake GPUs (gres ``File=`` must name character devices: made with mknod).

Everything lives in one temp dir (its own munge socket and key, its own ports), and clients find it
through ``SLURM_CONF``, so it never touches a Slurm or munge the host may run. Debian's Slurm 22.05
is built with multiple-slurmd: ``slurmd -N NAME`` runs one node of the config per daemon.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import wait_until

NODES = ("gpu1", "gpu2")
GPUS_PER_NODE = 2
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (kills every daemon and every job)."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        root, host = self.root, socket.gethostname().split(".")[0]
        for d in ("state", "spool", "dev", "logs"):
            (root / d).mkdir(exist_ok=True)
        files = []
        for node in NODES:
            for i in range(GPUS_PER_NODE):
                dev = root / "dev" / f"{node}-gpu{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
            files.append(f"NodeName={node} Name=gpu File={root}/dev/{node}-gpu[0-{GPUS_PER_NODE - 1}]")
        (root / "gres.conf").write_text("\n".join(files) + "\n")
        # proctrack/cgroup: every process of a job is in its cgroup and dies with it (with
        # proctrack/linuxproc a child of a batch script orphaned itself and survived).
        (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs=4 "
            f"RealMemory=1000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            for n in NODES
        )
        self.conf.write_text(
            f"""ClusterName=genqtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/logs/slurmctld.log
SlurmdLogFile={root}/logs/slurmd-%n.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
MinJobAge=600
{nodes}
PartitionName=gpu Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _daemon(self, name: str, *argv: str) -> None:
        log = open(self.root / "logs" / f"{name}.out", "wb")  # noqa: SIM115 - kept for the process' life
        self.procs.append(
            subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def start(self) -> SlurmCluster:
        self._write_config()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        r = self.root
        self._daemon(
            "munged", "munged", "-F", "--force", f"--socket={r}/munge.sock", f"--key-file={key}",
            f"--pid-file={r}/munged.pid", f"--log-file={r}/logs/munged.log", f"--seed-file={r}/munge.seed",
        )  # fmt: skip
        wait_until(lambda: (r / "munge.sock").exists(), 10, "munged's socket")
        self._daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(self.conf))
        for node in NODES:
            self._daemon(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(self.conf))
        wait_until(self._nodes_idle, 30, "both Slurm nodes idle", interval=0.3)
        return self

    def _nodes_idle(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise AssertionError(f"a Slurm daemon exited: {p.args[0]} ({self.log_tail()})")
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        return out.count("idle") == len(NODES)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (sacct needs slurmdbd; finished jobs stay for MinJobAge)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        first = out.splitlines()[0] if out else ""
        return dict(f.split("=", 1) for f in first.split() if "=" in f)

    def job_processes(self) -> list[int]:
        """Processes of this cluster's jobs still on the host (Slurm sets SLURM_JOB_ID in a job's
        environment; SLURM_CONF tells this cluster's from any other)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                env = environ.read_bytes().split(b"\0")
            except OSError:
                continue  # gone, or not ours to read
            if mine in env and any(v.startswith(b"SLURM_JOB_ID=") for v in env):
                found.append(int(environ.parent.name))
        return found

    def log_tail(self) -> str:
        logs = sorted((self.root / "logs").glob("*"))
        return "\n".join(
            f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]) for p in logs
        )

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (slurmd first, so their jobs' cgroups go)."""
        if self.procs and self.procs[1].poll() is None:
            self.run("scancel", "--full", "--user=root", check=False)
            with contextlib.suppress(AssertionError):
                wait_until(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 30, "jobs gone")
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        left = self.job_processes()
        assert not left, f"processes of Slurm jobs outlived the cluster: {left}"


def slurm_cluster(root: Path):
    """The cluster, or a skip (a failure with CI set) saying why Slurm cannot run here."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    why = None
    if missing:
        why = f"Slurm is not installed ({', '.join(missing)} missing; .ci/run installs it)"
    elif os.geteuid() != 0:
        why = "a Slurm cluster needs root (slurmd, mknod, cgroups)"
    elif not Path("/sys/fs/cgroup/freezer").is_dir():
        why = "proctrack/cgroup needs the cgroup v1 freezer at /sys/fs/cgroup/freezer"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return SlurmCluster(root).start()
