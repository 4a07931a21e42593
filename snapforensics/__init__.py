"""snapforensics: forensic analysis of PyTorch device-memory snapshots.

    import snapforensics as sf
    report = sf.diagnose("runs/a/rank0.pickle")   # see docs/api.md

The API (`load`, `diagnose`, `compare`, `forecast` and their results) is imported on first
use, so `import snapforensics` stays cheap (no numpy, no pandas, never torch).
"""

__version__ = "0.1.0"

_API = ("load", "diagnose", "compare", "forecast", "pipeline_forecast", "Report", "Comparison",
        "Forecast")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module("snapforensics.api"), name)
    raise AttributeError(f"module 'snapforensics' has no attribute {name!r}")
