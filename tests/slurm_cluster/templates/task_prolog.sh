#!/bin/sh
# TaskProlog (before the batch script and every srun task): "export" lines reach the task's env.
echo "export SLURM_TMPDIR=${scratch}/job_$${SLURM_JOB_ID}"
