"""Tools outside the served path: training, workloads, cost profiling, benchmark statistics,
the oracle bound, the soak test."""
