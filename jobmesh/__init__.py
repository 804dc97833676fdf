"""jobmesh: a durable distributed job coordinator on gevent.

This module deliberately imports nothing: the process entry (``jobmesh.__main__``)
must be able to monkey-patch before any other import, and tests import library
modules without patching anything.
"""

__version__ = "0.1.0"
