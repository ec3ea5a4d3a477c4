"""Timing helpers shared by the benchmarks."""
import statistics
import time


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn()``."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
