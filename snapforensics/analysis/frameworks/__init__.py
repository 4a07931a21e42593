"""Training frameworks: which one the run shows (detect.py) and fixes in its terms (fixes.py)."""
