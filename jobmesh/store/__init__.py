"""Durable job storage: the ``Store`` seam (base.py), the job record (job.py), the
columns and row form (columns.py), and the SQLite store (sqlite.py).

Below ``coordinator/``: imports only ``errors``, ``protocol/`` and itself.
"""
