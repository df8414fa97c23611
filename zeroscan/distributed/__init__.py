"""zeroscan.distributed: statistics across ranks with torch.distributed.

Every call here that takes a process group (or a DTensor, whose mesh is
one) is a COLLECTIVE: every rank of the group must make it, in the same
order, or the ranks that did wait until the group's timeout. zeroscan.stats
and zeroscan.stats_many never are: they refuse a DTensor and name the calls
here. Each first checks that the ranks agree on what they merge, and where
they do not every rank raises the same one-line error instead of merging.

`stats`, `stats_many` and `merge_stats` merge every rank's result rows with
all-reduces whose size does not depend on the world size W; each result is
a GlobalStats whose `mode` says what a rank's tensor meant (its own, a
piece of one tensor, a DTensor's shard or replica: global_stats.py says
more, and what waits on the host).

Data-parallel replicas (DDP) are compared, not merged: `compare_replicas`
reports which rank's gradient differs from the others (a NaN on one rank
only, a replica that diverged), with every rank's values: it gathers the
rows (W x N x 128 bytes), a diagnostic call, as are `gather_rows` and
`combine_rows` (the exact merge of gathered rows). The Monitor compares
replicas without gathering, in the all-reduces of its merge.

The modules, each importing only those above it:

    common              what every collective call shares: the group's
                        checks, the device its backend exchanges on, a
                        collective in flight (PendingMerge)
    agreement           the ranks agree on what they merge before they merge it
    allreduce_words     int64 words that carry floats, maxima and ranks
                        through exact all-reduces
    allreduce_replicas  replicas compared without a gather
    allreduce           result rows merged by two rounds of all-reduces
    replicas            which rank's copy differs, from gathered rows
    gather              gather_rows, combine_rows, compare_replicas
    global_stats        stats, stats_many, merge_stats, local_part, drop_uncounted

Beside the public API (`__all__`), the package exports the entry points of
a caller that packs result rows of its own and reads the merge's summary
itself (the Monitor across ranks):

    MergeInput          one rank's rows and flags for the merge (allreduce.Local)
    start_merge         both rounds over a process group: the summary, unread
                        (allreduce.start)
    Col, SUMMARY_WIDTH  the summary's columns and row width
    header_range        the least and greatest header words over the ranks
    local_part, MODE_SHARDED (and the other modes' MODE_ names)
                        what a rank scans of a DTensor, and how it is merged
    comm_device         the device a group's backend exchanges tensors on
    Merged, Difference, check_agreement, tensor_words
                        the agreement check, and the words of what must agree

and helpers of the merge that the tests reach here: `empty_rows`,
`rows_agree` and `replica_report` (`GatheredRows.replica_report` is the
public form of the last).
"""

from zeroscan.distributed.agreement import Difference, Merged, check_agreement, tensor_words
from zeroscan.distributed.allreduce import SUMMARY_WIDTH, Col, header_range
from zeroscan.distributed.allreduce import Local as MergeInput
from zeroscan.distributed.allreduce import start as start_merge
from zeroscan.distributed.common import PendingMerge, comm_device
from zeroscan.distributed.gather import GatheredRows, combine_rows, compare_replicas, gather_rows
from zeroscan.distributed.global_stats import (
    MODE_CONCATENATED,
    MODE_LOCAL,
    MODE_REPLICATED,
    MODE_SHARDED,
    GlobalStats,
    LocalPart,
    drop_uncounted,
    local_part,
    merge_stats,
    stats,
    stats_many,
)
from zeroscan.distributed.replicas import ReplicaMismatch, ReplicaReport, replica_report, rows_agree
from zeroscan.result_row import empty_rows

__all__ = [
    "GatheredRows", "GlobalStats", "LocalPart", "PendingMerge", "ReplicaMismatch", "ReplicaReport",
    "combine_rows", "compare_replicas", "drop_uncounted", "gather_rows", "local_part", "merge_stats", "stats",
    "stats_many",
]
