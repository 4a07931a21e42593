"""Analysis: lifetimes, phases, classification and rules over the snapshot model."""

from snapforensics.analysis.diagnose import diagnose
from snapforensics.analysis.diagnosis import Diagnosis, Finding

__all__ = ["diagnose", "Diagnosis", "Finding"]
