"""Pipeline stages: pure math (torch only) beside thin Prefect task wrappers (`stage.py`)."""
