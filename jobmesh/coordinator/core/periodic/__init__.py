"""The Periodic protocol's parts of the core: func index, worker sessions, locks, named
jobs, streams and the command table, behind PeriodicJobs (jobs.py)."""
