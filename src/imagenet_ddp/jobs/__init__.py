"""How a job's ranks start, meet, stop and are recorded."""
