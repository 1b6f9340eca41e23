"""Run settings and the dry-run's checks: torch-free, read while Snakemake parses."""
