"""The preflight stage: its job, its ranks' measurements, its report."""
