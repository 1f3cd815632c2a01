"""Tensor parallelism: one replica's model split over N worker processes (one per device;
on the CPU, one per share of the cores) under one scheduler, as vLLM's multiproc executor.
"""
