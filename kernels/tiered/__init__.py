"""Device-planned residency for tiered caches: which of a step's candidate rows of a host pool
already sit in a device cache, which slots the others take, and their copy from host memory, with
no host synchronisation (so the step can be captured in a CUDA graph); a decode token's write-through
from the device ring to the host pool (with a key page's summary) in one launch."""

from hearth.kernels.tiered.coarse_step import CANDIDATE_TOPKS, CandidateTopk, coarse_step, sort_fits
from hearth.kernels.tiered.residency import ResidencyPlan, copy_rows, gather_misses, plan_residency
from hearth.kernels.tiered.write_through import write_row, write_through_page

__all__ = ["CANDIDATE_TOPKS", "CandidateTopk", "ResidencyPlan", "coarse_step", "copy_rows", "gather_misses",
           "plan_residency", "sort_fits", "write_row", "write_through_page"]
