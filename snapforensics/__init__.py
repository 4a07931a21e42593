"""snapforensics: forensic analysis of PyTorch device-memory snapshots."""

__version__ = "0.1.0"
