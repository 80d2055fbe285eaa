"""Sim-to-real fidelity: how far the simulator's predictions are from real runs."""
