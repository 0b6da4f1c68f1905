"""Programmatic dependent launch (PDL, NVIDIA sm_90+) between the op's kernels.

A kernel launched with `launch_attributes(True)` (CUDA's
`cudaLaunchAttributeProgrammaticStreamSerialization`) may start before the
kernel ahead of it in the stream has finished: as soon as every block of
that kernel has run `allow_dependents()` (`griddepcontrol.launch_dependents`)
or exited. Its blocks may then do what needs nothing of that kernel (index
math, page-table reads, staging weights, copying cache rows the op does not
write) and must run `wait_for_producers()` (`griddepcontrol.wait`) before the
first read of anything a kernel ahead of it writes, and before writing
anything such a kernel reads. The wait returns once the kernels ahead have
completed and their writes are visible; where `allow_dependents` sits decides
only when the dependent's blocks are scheduled, never what they see. Without
the attribute both instructions are no-ops, so the kernels are the same with
PDL on and off (`GpuPlan.pdl`).

Where the op's kernels let their dependents in: late, so that a dependent's blocks never wait
for SMs the kernel ahead still needs (the q step, the merge and the `mma`/`wgmma`/FMA
attention kernels when their blocks exit; the TMA attention kernel once its key loop is done;
the output step early, as nothing of the op follows it). With every kernel triggering at entry,
PDL cost 6-10 us per call (H100, 2026-12-05, `gpu_bench bench`, 16 h b8 8k 69.6 -> 77.6 us):
the attention kernel's blocks, a whole SM each, sat waiting on SMs the q step's last blocks needed.

Why every launched kernel with the attribute waits (its early-exiting blocks
too): a kernel completes only once its own wait returned, so the kernels
ahead of it are complete too; the chain stays ordered end to end.

Both are inline PTX with a memory clobber (as CUDA's own
`cudaGridDependencySynchronize`), so that the compiler moves no load or store
across the wait.
"""

from std.sys._assembly import inlined_assembly

from max.gpu.host.launch_attribute import LaunchAttribute, LaunchAttributeID, LaunchAttributeValue


@always_inline
def wait_for_producers():
    """Blocks until the kernels this launch depends on have completed and their writes are visible."""
    inlined_assembly["griddepcontrol.wait;", NoneType, constraints="~{memory}", has_side_effect=True]()


@always_inline
def allow_dependents():
    """Lets the next kernel (launched with PDL) be scheduled once every block of this one got here or exited."""
    inlined_assembly["griddepcontrol.launch_dependents;", NoneType, constraints="~{memory}", has_side_effect=True]()


def launch_attributes(pdl: Bool) -> List[LaunchAttribute]:
    """A launch's attributes: programmatic stream serialization with `pdl`, none without."""
    var attributes = List[LaunchAttribute]()
    if pdl:
        attributes.append(LaunchAttribute(LaunchAttributeID.PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttributeValue(True)))
    return attributes^
