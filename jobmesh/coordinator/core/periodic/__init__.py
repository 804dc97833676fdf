"""The Periodic protocol's parts of the core: named jobs, func workers, locks, waits."""
