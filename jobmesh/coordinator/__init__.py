"""The coordinator: the scheduling authority (core, store, servers, runtime)."""
