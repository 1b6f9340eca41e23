"""A real multi-node SLURM cluster in Linux namespaces on this machine (see cluster.py)."""
