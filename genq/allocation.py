"""Which Slurm job this process runs in, if any: status shows it beside each worker, and a node job
names its logs after it, so an operator can go from a worker in ``genq status`` to ``scontrol``."""

from __future__ import annotations

import os


def slurm_job() -> str | None:
    """``JOBID_TASK`` for a task of a job array (as squeue and scancel spell it), ``JOBID`` for a
    plain job, None outside Slurm. Slurm sets these variables in every batch job's environment.
    A task's own SLURM_JOB_ID will not do for scontrol: the first task's is the array's id, and
    ``scontrol requeue`` of that id requeues every task of the array."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None
