#!/bin/sh
# Prolog (root, on every node of the allocation at job start): the job's private scratch dir.
mkdir -p "${scratch}/job_$${SLURM_JOB_ID}"
