"""Isolation: the pure control law, simulated GPU physics and the thin actuators (signals, MPS, NVML)."""
