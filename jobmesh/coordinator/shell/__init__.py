"""The shell: start-up, standby and leadership, the core's loop and its timers, replies,
the storage outage, housekeeping and the schedule file."""
