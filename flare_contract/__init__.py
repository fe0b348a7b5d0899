"""What ``ignition`` writes and ``helios`` reads, as plain data.

The offline toolchain and the runtime both import this package and nothing
of each other (``tests/test_import_direction.py`` holds them to it). It
imports neither torch nor either side: graph descriptors and their kinds
(``graphs``), and the catalog manifest with the program contract it records
(``manifest``).
"""
