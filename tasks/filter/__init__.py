"""Dynamic sampling (``algorithm.filter_groups``): pure choice in `core.py`, the Prefect stage in `stage.py`."""
