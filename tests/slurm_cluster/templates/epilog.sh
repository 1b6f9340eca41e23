#!/bin/sh
# Epilog (root, every node, job end): remove the job's scratch dir, as real sites do.
# Only installed with start_cluster(epilog_cleans_scratch=True): the tests want to see
# whether the workflow cleaned up after itself.
rm -rf "${scratch}/job_$${SLURM_JOB_ID}"
