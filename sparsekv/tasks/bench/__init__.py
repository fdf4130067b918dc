"""task=bench: speed beside the physical floors measured in the same run (floors.py), HF transformers beside it
(baseline.py), and the summary tables of its records (summary.py)."""
