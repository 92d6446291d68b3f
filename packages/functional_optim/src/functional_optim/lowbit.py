"""Low-bit optimizer states: the public pieces a sharding layer needs, and the transform.

* :func:`quantized_state` and the aliases (``fo.adamw8bit``, ...): see
  :mod:`functional_optim._lowbit.transform`.
* :class:`Placement`, :class:`Sharing`, :func:`sharing_context`: how a layer that shards
  parameters into contiguous pieces (ZeRO ``partition="flat"``) tells the low-bit step where
  each piece lies, so that blocks stay those of the whole parameter (see
  :mod:`functional_optim._lowbit.layout`).
* :func:`dequantized_state_dict` / :func:`quantized_state_dict`: convert an
  ``fo.Optimizer`` state dict between low-bit and fp32 moments.
"""

from functional_optim._lowbit.convert import dequantized_state_dict, quantized_state_dict
from functional_optim._lowbit.layout import Placement, Sharing, sharing_context
from functional_optim._lowbit.regions import elements_to_region, region_to_elements, touched_blocks
from functional_optim._lowbit.transform import quantized_state

__all__ = [
    "Placement",
    "Sharing",
    "dequantized_state_dict",
    "elements_to_region",
    "quantized_state",
    "quantized_state_dict",
    "region_to_elements",
    "sharing_context",
    "touched_blocks",
]
