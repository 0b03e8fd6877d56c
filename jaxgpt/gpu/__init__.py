"""Compiling for NVIDIA GPUs this machine does not have (target descriptions, compile-only devices)."""
