"""Analysis: lifetimes, phases, classification and rules over the snapshot model."""

from snapforensics.analysis.diagnosis import Diagnosis, Finding
from snapforensics.analysis.engine import diagnose

__all__ = ["diagnose", "Diagnosis", "Finding"]
