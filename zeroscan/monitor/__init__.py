"""zeroscan.Monitor: every gradient and weight of a model, every step, cheaply.

How a training loop uses it:

    with zeroscan.Monitor(model, optimizer) as monitor:
        for x, y in data:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()          # the Monitor scans here, just before the update
    print(monitor.report())

With an optimizer (and auto=True, the default) the Monitor scans from a step
pre-hook of the optimizer, so the loop needs no change. Without one (or with
auto=False), call `monitor.step()` once per optimizer step, after backward()
and any clipping, before zero_grad(); `monitor.step(loss)` also lets the
cause analysis start from the loss instead of the model's outputs.

A step is opened when a backward pass through the model's outputs finishes
(backward.py). Gradients reset after it with no step mean a skipped step
(GradScaler skips one on inf/NaN), which is still recorded; gradients left
untouched until the next backward pass mean gradient accumulation, and the
step goes on. A module or parameter assigned to the model later (a new head)
is taken in at the next step (structure.py).

What one monitored step costs: each gradient and each weight is read once,
in one zeroscan stats_many call per device at the optimizer step (after
clipping and unscaling, however many backward passes accumulated the
gradients). A skipped step's gradients, which no optimizer hook sees, are
held (not copied) from the end of backward and read once the loop lets them
go, at the model's next forward or backward pass. Until the Monitor has seen
the loop let go of its gradients after a step (zero_grad() setting them to
None), and in a loop that zeroes them in place, the gradients are also read
when backward ends, as a skipped step then leaves nothing to read later;
otherwise only a witness is read there, the first 64 values of at most 8
gradients (deferred.py says what each rule sees). The int64 result
buffers stay on the device in a bounded ring (`history` steps); nothing is
read, so there is no host
sync, until `report()` copies the ring once per device (the CPU's is read
where it is) and judges it, column-wise with numpy (table.py, series.py):
10k parameters x 64 steps take well under a second.
With `histogram=True` the same scans (stats_many_hist instead of
stats_many: no other pass, call or sync) also count the exact
log2-magnitude histogram of every gradient and weight; report() gives the
latest step's as `Report.histograms` (grad_histograms.py says what the ring keeps).
A tensor the native scan cannot read (a frozen parameter of dtype uint16,
float8_e4m3fnuz or a quantized one, say: zeroscan.ops.scannable_form) is
left out, with one INFO "not_scanned" finding naming it and its dtype; the
rest of the model is scanned as always.

The Monitor lives as long as its user holds it: its hooks hold it weakly,
and neither a pickled nor a copied model carries them (hooks.py). report()
may be called from another thread while training runs (the two take
turns, a waiting step first: turns.py; see Monitor.report).

Where a gradient lives when it is read is grad_source.py: .grad, or, in
frameworks that move it after backward, Megatron-core's main_grad and
DeepSpeed's ZeRO partitions (read through this rank's partition, merged
across ranks like a DTensor's shards); the optimizers of those frameworks
(frameworks.py) are stepped, skip steps and hold the parameters in ways of
their own, which the Monitor reads.

Why a gradient is None, or exactly zero, is the cause analysis of
causes.py: what the autograd engine says at the end of backward, a walk of
the autograd graph from the outputs (graph.py), and a probe of one forward
pass (probe.py), only when an unexplained None gradient shows up. What the
records mean is rules.py, a pure function testable without a model; one
root cause is one finding (grouping.py).

Across ranks (`process_group=`; ranks.py): building the Monitor and each
monitored step are then collectives. Each step merges its rows over the
group with two rounds of all-reduces of a few hundred bytes per tensor,
whatever the world size (zeroscan/distributed/allreduce.py): sharded tensors (FSDP2,
tensor parallel) are merged into the statistics of the full tensor, and
replicas (DDP) are compared, with findings that name the ranks that differ.
The step keeps only the merged summary, 2P x 192 + 96 bytes on the device the
group's backend uses, until report() reads it.
report() issues no collective: any rank may call it, alone (rank 0, to
log), at any point of a step; every rank that calls it gets the same global
findings. A step between backward() and optimizer.step() stays open across
ranks (ending it would be a collective), so such a report judges the steps
before it. What stays this rank's own: the cause analysis of a None
gradient, activation findings (this rank's batch) and notes on tensors that
could not be scanned. Every rank must build its Monitor on the same model
(after wrapping it in DDP or fully_shard), with the same `every`, and step
it the same number of times: a Monitor whose ranks hold different parameters
raises on every rank when it is built, and report() raises if the ranks
recorded different steps. Which group to pass (DDP, FSDP2, HSDP, tensor and
pipeline parallel) is in the README.
"""

from zeroscan.monitor.monitor import Monitor
from zeroscan.monitor.step_record import Slot
from zeroscan.monitor.report import GLOBAL_NAME, Finding, Report, Thresholds
from zeroscan.verdicts import Cause, Severity

__all__ = ["GLOBAL_NAME", "Cause", "Finding", "Monitor", "Report", "Severity", "Slot", "Thresholds"]
