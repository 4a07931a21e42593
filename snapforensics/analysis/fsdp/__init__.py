"""FSDP facts several rules share: units and their reshard rows (units.py), FSDP's range
names (ranges.py)."""
