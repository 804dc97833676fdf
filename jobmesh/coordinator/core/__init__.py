"""The core: every part of the coordinator's state and the rules that change it.

It runs on one greenlet but knows nothing of gevent, sockets or start-up: the ports hand it
events and the shell drives its loop. What they see of it is its face, four modules:

* ``face.py``: ``CoordinatorCore``, the one object they hold (``apply(event, now)``, the
  batch's end, what a batch commits and sends, recovery, figures, the price of a
  Periodic request);
* ``events.py``: the typed events ``apply`` takes;
* ``peers.py``: what the core uses of a connection (protocols the ports implement);
* ``figures.py``: the shapes of the figures and the metrics registry the metrics port
  exports them through.

Every other module is a part (the job table, the timers, the JSON and Periodic jobs,
requests, schedules, limits, and the pure helpers they share): only the core composes and
uses them, and tests/unit/test_import_direction.py holds every module outside the core to
that."""
