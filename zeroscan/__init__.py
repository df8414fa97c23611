"""zeroscan: is this tensor truly zero, underflowed, non-finite, or healthy?

One fused pass over a tensor's memory counts exact zeros, subnormals,
near-zero values, NaN/Inf and negatives, and takes min/max |x| and the
mean/std/norm of the finite values, leaving the numbers on the device until
they are read.
"""

from zeroscan.ops import NUM_FIELDS
from zeroscan.reference import reference_stats
from zeroscan.stats import FIELDS, Stats, StatsBatch, stats, stats_many

__all__ = [
    "FIELDS",
    "NUM_FIELDS",
    "Stats",
    "StatsBatch",
    "reference_stats",
    "stats",
    "stats_many",
]
__version__ = "0.1.0"
