"""jobmesh inside other frameworks: ``jobmesh.contrib.django`` (a backend for Django's tasks)."""
