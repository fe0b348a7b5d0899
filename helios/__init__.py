"""Helios: load a catalog of prepared programs, schedule it, execute it, serve it."""
