"""The report stage: the table of all runs, its figures, SLURM accounting."""
