"""The Periodic job-server protocol port (docs/PERIODIC.md): the codec so far."""
