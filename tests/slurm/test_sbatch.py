"""scripts/slurm/train.sbatch under a real Slurm: a slurmctld and two slurmd (nodes n1 and n2,
both on this machine) started for this module in a directory of its own, and stopped after it.

Each job trains tests/train/test_fault_tolerance.py's tiny fp32 config on 2 gloo ranks, one per
node (NPROC_PER_NODE=1), and is compared with the same config run by `hyperparallel train --nproc
2` on this machine: the same 2 ranks, the same sums in the same order, so the very same losses.

To stop a job at a point it cannot have passed, the test stops its ranks (SIGSTOP) once the
checkpoint of step 2 is complete, has Slurm send SIGTERM, and lets them go on (SIGCONT) once the
signal is pending in both.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.test_cli_train import ROOT, losses
from tests.train.test_fault_tolerance import STEPS, rank_pids, resume, write_config

SBATCH = ROOT / "scripts/slurm/train.sbatch"
SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = {name: shutil.which(name, path=SBIN) for name in ("slurmctld", "slurmd")}
NODES = ("n1", "n2")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}
HANG_S = 600  # a bound on any wait here, for a hang only: these jobs take seconds

pytestmark = pytest.mark.skipif(not all(DAEMONS.values()),
                                reason="slurmctld and slurmd are not installed (`make test-slurm` installs them)")

CONF = """\
ClusterName=test
SlurmctldHost=localhost
SlurmctldPort={port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
ReturnToService=2
KillWait=2
MinJobAge=300
InactiveLimit=0
MailProg=/bin/true
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port={port1}-{port2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
# auth/none, cred/none: no munge. cred_expire=5 and the 1 s scheduler: a requeued job starts
# again within seconds (Slurm holds it until the credentials of its last run expire). KillWait=2:
# a cancel's SIGKILL follows its SIGTERM after 2 s.


def free_ports(n: int) -> int:
    """The first of n consecutive ports free now on 127.0.0.1 (the nodes' Port= is a range)."""
    while True:
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for other in range(port + 1, port + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", other))
            except OSError:
                continue
            return port


class Slurm:
    """The cluster: its directory (the submit directory of the jobs too) and its commands."""

    def __init__(self, root: Path, cache: Path):
        self.dir, self.cache = root, cache
        for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (root / sub).mkdir(parents=True)
        port = free_ports(1 + len(NODES))
        (root / "slurm.conf").write_text(CONF.format(port=port, port1=port + 1, port2=port + len(NODES), d=root,
                                                     user=getpass.getuser(), cpus=os.cpu_count()))
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"), PATH=SBIN)
        self.daemons = [self._start([DAEMONS["slurmctld"], "-D"], "slurmctld")]
        self.daemons += [self._start([DAEMONS["slurmd"], "-D", "-N", n], n) for n in NODES]
        self.wait_for(lambda: self("sinfo", "-h", "-o", "%D %t", check=False).strip() == f"{len(NODES)} idle",
                   "the nodes to be idle")

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        with open(self.dir / "log" / f"{name}.out", "w") as out:
            return subprocess.Popen(args, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def __call__(self, *args: str, check: bool = True, timeout: float = 10, **env) -> str:
        """A Slurm command; its stdout (a daemon that no longer answers ends the test, never hangs it)."""
        try:
            done = subprocess.run(args, env={**self.env, **env}, cwd=self.dir, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            if check:
                raise
            return ""
        if check and done.returncode:
            raise AssertionError(f"{' '.join(args)}: {done.stderr}")
        return done.stdout

    def wait_for(self, ready, what: str, job: str | None = None, poll_s: float = 0.05) -> None:
        """Poll `ready` until it holds; fail at once if a daemon or `job` has ended (the job
        checked once a second: scontrol is a process each time)."""
        deadline, next_check = time.monotonic() + HANG_S, time.monotonic() + 1
        while not ready():
            now, ended = time.monotonic(), False
            if job is not None and now > next_check:
                ended, next_check = self.job(job)["JobState"] in ENDED, now + 1
            if ended or now > deadline or any(d.poll() is not None for d in self.daemons):
                logs = "\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted((self.dir / "log").iterdir()))
                raise AssertionError(f"waited for {what} in vain; job output:\n{self.output(job)}\nlogs:\n{logs}")
            time.sleep(poll_s)

    def submit(self, config: Path, **env) -> str:
        """`sbatch train.sbatch CONFIG` from the cluster's directory (the submit directory): its job id.
        The submitting environment reaches the job (sbatch's default --export=ALL)."""
        env = {**dict(HYPERPARALLEL_PYTHON=sys.executable, NPROC_PER_NODE="1", PORT=str(free_ports(1)),
                      HYPERPARALLEL_CACHE=str(self.cache), OMP_NUM_THREADS="1"), **env}
        submitting = {k: v for k, v in {**self.env, **env}.items() if v is not None}  # (None: not set)
        done = subprocess.run(["sbatch", "--parsable", str(SBATCH), str(config)], env=submitting, cwd=self.dir,
                              capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        fields = self("scontrol", "-o", "show", "job", job).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait(self, job: str, restarts: int = 0) -> dict[str, str]:
        """Wait for the job's run number `restarts` to end (polling scontrol: sbatch --wait polls
        every 2 s); the job's record."""
        record = {}

        def ended() -> bool:
            record.update(self.job(job))
            return int(record["Restarts"]) == restarts and record["JobState"] in ENDED

        self.wait_for(ended, f"job {job} to end", poll_s=0.2)
        return record

    def output(self, job: str | None) -> str:
        path = self.dir / f"hyperparallel-{job}.out"
        return path.read_text() if path.is_file() else ""

    def stop(self) -> None:
        """Cancel every job, shut the daemons down, and kill whatever of this cluster is left."""
        if self.daemons[0].poll() is None:
            self("scancel", "-u", getpass.getuser(), "--full", "-s", "KILL", check=False, timeout=5)
            for _ in range(50):
                if not self("squeue", "-h", "-o", "%i", check=False, timeout=2).strip():
                    break
                time.sleep(0.1)
            self("scontrol", "shutdown", check=False, timeout=5)  # slurmctld and every slurmd
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=5)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        # What outlives slurmd: a slurmstepd (its log file, under this directory, open) and a job's
        # processes (this cluster's SLURM_CONF and a SLURM_JOB_ID in their environment).
        conf = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
                ours = conf in env and any(e.startswith(b"SLURM_JOB_ID=") for e in env)
                ours = ours or any(os.readlink(fd).startswith(f"{self.dir}/") for fd in (proc / "fd").iterdir())
                if ours:
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                continue


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = Slurm(tmp_path_factory.mktemp("slurm"), tmp_path_factory.mktemp("cache"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def config(slurm) -> Path:
    """The tiny config (its logging.run_dir is the script's to set)."""
    return write_config(slurm.dir, slurm.dir / "unused")


@pytest.fixture(scope="module")
def uninterrupted(slurm, config) -> list[float]:
    """The same config on 2 ranks of this machine, `hyperparallel train --nproc 2`."""
    run_dir = slurm.dir / "reference"
    done = subprocess.run([sys.executable, "-m", "hyperparallel", "train", str(config), "--nproc", "2",
                           "--set", f"logging.run_dir={run_dir}"], cwd=slurm.dir, capture_output=True, text=True,
                          timeout=HANG_S, env=dict(os.environ, HYPERPARALLEL_CACHE=str(slurm.cache),
                                                   OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    assert len(losses(run_dir)) == STEPS
    return losses(run_dir)


def test_each_node_runs_one_torchrun_and_a_run_dir_without_a_checkpoint_is_moved_aside(slurm, config):
    """The script's command lines, printed by /bin/echo in place of Python: the job takes a second."""
    run_dir = slurm.dir / "started-before"  # as a job requeued before its first checkpoint leaves it
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    job = slurm.submit(config, HYPERPARALLEL_PYTHON="/bin/echo", RUN_DIR=str(run_dir), PORT=None)
    assert slurm.wait(job)["JobState"] == "COMPLETED", slurm.output(job)
    (moved,) = slurm.dir.glob("started-before.moved-*")  # kept, under another name
    assert (moved / "metrics.jsonl").read_text() == "{}\n" and not run_dir.exists()
    port = 29500 + int(job) % 2000  # PORT's default, from the job id
    lines = sorted(line for line in slurm.output(job).splitlines() if line.startswith("-m torch.distributed.run"))
    assert lines == [f"-m torch.distributed.run --rdzv-conf is_host={first} --nnodes 2 --nproc-per-node 1 "
                     f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id {job} --max-restarts 3 "
                     f"-m hyperparallel train {config} --set logging.run_dir={run_dir}" for first in (0, 1)]


def test_a_2_node_job_trains_one_rank_per_node_to_the_losses_of_nproc_2(slurm, config, uninterrupted):
    job = slurm.submit(config)
    record = slurm.wait(job)
    out = slurm.output(job)
    assert record["JobState"] == "COMPLETED" and record["NumNodes"] == "2", out
    # with one torchrun per node of 1 rank each, a world of 2 ranks is both nodes' torchruns in one run
    assert "layout: 2 ranks" in out and f"done: {STEPS} steps" in out, out
    run_dir = slurm.dir / "runs" / f"hyperparallel-{job}"  # the default: JOBNAME-JOBID in the submit directory
    assert losses(run_dir) == uninterrupted


def pending(pid: int, sig: signal.Signals) -> bool:
    """Whether `sig` waits in the (stopped) process `pid`."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in masks)


def node_of(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SLURMD_NODENAME="))


def test_sigterm_saves_a_checkpoint_and_the_requeued_job_resumes_to_the_uninterrupted_losses(
        slurm, config, uninterrupted):
    job = slurm.submit(config)
    run_dir = slurm.dir / "runs" / f"hyperparallel-{job}"
    pids = {}

    def started() -> bool:  # (found while they start: once step 2 is saved, no time is lost finding them)
        pids.update(rank_pids(slurm.cache))
        return len(pids) == 2

    slurm.wait_for(started, "the ranks to start", job)
    slurm.wait_for((run_dir / "checkpoints" / "step_00000002" / "checkpoint.json").is_file,
                   "the checkpoint of step 2", job, poll_s=0.01)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    assert sorted(node_of(pid) for pid in pids.values()) == list(NODES)  # one rank per node
    # What --signal=TERM@300 sends 5 min before the time limit: SIGTERM to every process of the
    # step (both torchruns and their ranks; not the batch shell).
    slurm("scancel", "-s", "TERM", job)
    slurm.wait_for(lambda: all(pending(pid, signal.SIGTERM) for pid in pids.values()), "SIGTERM to reach the ranks")
    resume(pids)
    slurm.wait(job)
    out = slurm.output(job)
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert len(stopped) == 1, out
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    assert 2 < step < STEPS and (checkpoint / "checkpoint.json").is_file(), out
    # `scontrol requeue` takes the ended job: the script runs again under the same job id, so with
    # the same RUN_DIR, finds the checkpoint and resumes from it (its output appended to the file).
    slurm("scontrol", "requeue", job)
    record = slurm.wait(job, restarts=1)
    out = slurm.output(job)
    assert record["JobState"] == "COMPLETED", out
    assert f"resumed from {checkpoint} at step {step}" in out and f"done: {STEPS} steps" in out, out
    assert losses(run_dir) == uninterrupted
