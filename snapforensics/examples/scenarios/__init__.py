"""The FSDP scenario matrix: layouts, models, wrapping, the truth probe; run.py runs it."""
