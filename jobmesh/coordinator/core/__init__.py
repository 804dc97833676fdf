"""The core: every part of the coordinator's state and the rules that change it.

It runs on one greenlet but knows nothing of gevent, sockets or start-up: the ports hand it
events and the shell drives its loop. ``CoordinatorCore`` (face.py) is all they see."""
