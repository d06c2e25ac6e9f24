"""How often to checkpoint, and what it costs: the interval advisor, drive wear, write-cache facts.

* :mod:`.model`: the pure interval model (Young/Daly, expected lost time per interval);
* :mod:`.history`: what a ``Checkpointer`` measures about its own saves, and ``every="auto"``;
* :mod:`.wear`: bytes written per target and drive endurance;
* :mod:`.devinfo`: the filesystem, write cache and FUA under a directory;
* :mod:`.sources`: reading measurements from a ``Checkpointer``, its root, or a bench JSON;
* :mod:`.multilevel`: :func:`advise_levels`, ``every``, ``replicas`` and ``remote_every`` together;
* :mod:`.interval`: :func:`advise` puts them together into the interval advice, from its nouns
  (:class:`Failures`, :class:`CostOverrides`, :class:`Wear`); :mod:`.advice` is what it returns
  and prints; :mod:`fastpersist.tools.advise` is ``fastpersist advise``.

See docs/advisor.md.
"""

from .advice import Advice
from .devinfo import DeviceInfo, device_info
from .history import SaveHistory
from .interval import advise
from .model import CostOverrides, Costs, Outcome, best_every, daly_interval_s, job_mtbf_s, outcome, young_interval_s
from .multilevel import Failures, LevelAdvice, LevelCosts, LevelPlan, advise_levels
from .wear import Endurance, Wear, WearLog

__all__ = [
    "Advice",
    "CostOverrides",
    "Costs",
    "DeviceInfo",
    "Endurance",
    "Failures",
    "LevelAdvice",
    "LevelCosts",
    "LevelPlan",
    "Outcome",
    "SaveHistory",
    "Wear",
    "WearLog",
    "advise",
    "advise_levels",
    "best_every",
    "daly_interval_s",
    "device_info",
    "job_mtbf_s",
    "outcome",
    "young_interval_s",
]
