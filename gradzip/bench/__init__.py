"""Benchmarks: ``gradzip bench kernels`` times every compressor against one memory pass."""
