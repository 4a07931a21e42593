"""Forecast: the peak at other world sizes, strategies, checkpointing and micro-batches
(core.py: forecast(); replay.py the replay; documents.py its results; docs/forecast.md)."""
