"""Autotuning: search space, measurement (the one Timer), tuning database, tuner, policy."""
