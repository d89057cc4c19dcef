"""The ground floor: what every layer of raysgd uses, on the standard library alone.

- :mod:`raysgd.base.checks`: the one argument checker; its error names the argument, what it expects and what it
  was given, before any actor starts.
- :mod:`raysgd.base.environment`: every environment variable raysgd reads, in one table (name, default, check,
  doc), read through :func:`raysgd.base.environment.get`.
- :mod:`raysgd.base.stateful`: the ``Stateful`` protocol (``state_dict``/``load_state_dict``) every component a
  checkpoint holds follows, and the save and restore of a named mapping of them.
- :mod:`raysgd.base.durable_files`: the ``fsync`` of a written file and of a folder's entries (a rename into it),
  for every module that writes a file in place.
- :mod:`raysgd.base.paths`: how a path a user gives is read (``~`` the home folder, a relative path from the
  working directory, a URI as it is), the same everywhere.

Layer -1: below the exceptions, keys and meters of layer 0, so that every module may import it; it imports nothing
of raysgd and nothing outside the standard library.

Example:
    >>> from raysgd.base import checks, environment
    >>> environment.get("SGD_RESIZE_COOLDOWN_S") >= 0
    True
"""
