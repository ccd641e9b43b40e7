"""The parts of ``benchmarks/pipeline.py``, one concern a module; the script runs them.

- ``settings``: paths, the names of stages and runs, targets, timeouts, the quiet environment.
- ``workload``: the shared work (models, tokenizer, prompts) and the ppoflow config it builds.
- ``ppoflow_runs``: ppoflow three ways (flow, ray+store, direct) and the solo flows, the Baton
  turn-taking; the child-side entry and the driver-side launchers.
- ``peers``: TRL in its own venv (built on first use), run through ``benchmarks/peers/``.
- ``children``: subprocesses: start, wait, collect their JSON line, clean up what they left.
- ``measure``: CPU seconds and peak RSS of a process tree, read from /proc.
- ``report``: medians over rounds, the overhead split, comparisons, the printed table.
"""
