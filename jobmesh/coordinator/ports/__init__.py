"""The ports: connection handlers that turn bytes into core events and replies into bytes
(the JSON worker and client ports, the Periodic port, the metrics and dashboard port)."""
