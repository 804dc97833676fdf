"""The wire: framing, typed messages, job states and task payloads (the seeds' "common")."""
