"""Drop-ins for ``torch.distributed.algorithms.model_averaging`` (import the submodules).

Beyond torch (ours, not torch's): the DiLoCo-family averagers of :mod:`.diloco`, :mod:`.sparseloco`,
:mod:`.warm_start` and MuLoCo's inner optimizer (:mod:`.muloco`), re-exported here.
"""

from compat_api.algorithms.model_averaging.diloco import (
    DiLoCoAverager,
    HierarchicalDiLoCoAverager,
    default_outer,
    slowmo_averager,
)
from compat_api.algorithms.model_averaging.muloco import MuonAdamW, muloco
from compat_api.algorithms.model_averaging.sparseloco import SparseLoCoAverager
from compat_api.algorithms.model_averaging.warm_start import WarmStartDiLoCoAverager

__all__ = [
    "DiLoCoAverager",
    "HierarchicalDiLoCoAverager",
    "MuonAdamW",
    "SparseLoCoAverager",
    "WarmStartDiLoCoAverager",
    "default_outer",
    "muloco",
    "slowmo_averager",
]
