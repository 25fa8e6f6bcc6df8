"""Measuring: the cost-table profiler, the step breakdown, streaming metrics, the serving
benchmark's statistics and frontier, the oracle bound, the workloads and the soak test.
"""
