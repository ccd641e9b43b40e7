"""The stages as Prefect tasks: one task run per stage per step, named after the stage and step
(``generate[step=3]``), never cached (they take handles and write the store).

The stage functions themselves (``tasks.<stage>.stage``) are plain Python and import no Prefect:
the worker processes that import their modules for the worker-side functions (``generate_rows``,
``score_rows``, ...) stay free of it. The flows call these tasks, with the run's retry options.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.advantage import stage as advantage_stage
from tasks.filter import stage as filter_stage
from tasks.generate import stage as generate_stage
from tasks.logprobs import stage as logprobs_stage
from tasks.score import stage as score_stage
from tasks.update import stage as update_stage
from tasks.validate import stage as validate_stage

generate = task(name="generate", cache_policy=NO_CACHE, task_run_name="generate[step={step}]")(
    generate_stage.generate
)
score = task(name="score", cache_policy=NO_CACHE, task_run_name="score[step={step}]")(
    score_stage.score
)
filter_groups = task(
    name="filter", cache_policy=NO_CACHE, task_run_name="filter[step={step}, round={job.round}]"
)(filter_stage.filter_groups)
logprobs = task(name="logprobs", cache_policy=NO_CACHE, task_run_name="logprobs[step={step}]")(
    logprobs_stage.logprobs
)
advantage = task(name="advantage", cache_policy=NO_CACHE, task_run_name="advantage[step={step}]")(
    advantage_stage.advantage
)
update = task(name="update", cache_policy=NO_CACHE, task_run_name="update[step={step}]")(
    update_stage.update
)
validate = task(name="validate", cache_policy=NO_CACHE, task_run_name="validate[step={step}]")(
    validate_stage.validate
)
