"""Turning a canonical spec into entry files: the TileLang adapter and the device compilers.

compiler   the one place that calls TileLang; runs in worker processes
devices    the CUDA device compiler as a strategy (nvcc, NVRTC), chosen once
nvrtc      NVRTC in process, with precompiled headers
"""
