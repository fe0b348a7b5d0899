"""Ignition: recipe -> capacity plan -> captured catalog of prepared programs."""
