"""Start or attach to Ray, and carve it into resource pools.

A *pool* is a placement group whose bundles each stand for one worker's devices:
``{"CPU": 0.5, <acc>: devices_per_bundle}`` where ``<acc>`` is ``GPU`` on a GPU cluster or a
custom resource (``gpu_slot``) on a CPU machine, so the same placement code runs and is tested
everywhere. A bundle is one device, except in a rollout pool whose vLLM engine is split over
``rollout.tensor_parallel_size`` devices: each of its bundles holds that many. Roles that share a
pool are placed on the same bundles and take turns on the devices (see ``infra.colocate``).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from infra.config import ResourcesConfig


class ResourceError(RuntimeError):
    """The Ray cluster cannot give a pool what it asks for; the message says which resource."""


def ensure_ray(res: ResourcesConfig, *, pools_devices: int) -> bool:
    """Attach to ``res.ray_address`` / ``RAY_ADDRESS`` or start a private local instance.

    Returns True when this call started Ray (the caller shuts it down). A local instance gets
    ``pools_devices`` fake accelerator slots when it has no real GPUs.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = res.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    resources: dict[str, float] = (
        {} if res.accelerator_resource == "GPU" else {res.accelerator_resource: pools_devices}
    )
    ray.init(
        address="local",
        num_cpus=res.num_cpus or max(2, os.cpu_count() or 2),
        resources=resources,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="rp"),  # honours TMPDIR; keep it short (socket paths)
        log_to_driver=True,
        configure_logging=False,
    )
    return True


@dataclass
class ResourcePool:
    """A named placement group of ``size`` bundles of ``devices_per_bundle`` devices each."""

    name: str
    size: int
    accelerator: str
    group: PlacementGroup
    devices_per_bundle: int = 1

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle
        )

    def actor_options(self, bundle: int, *, share: float) -> dict[str, Any]:
        """Options for an actor taking ``share`` of each device of bundle ``bundle`` (on a GPU
        cluster Ray then shows the actor that bundle's GPUs in ``CUDA_VISIBLE_DEVICES``)."""
        devices = share * self.devices_per_bundle
        return {
            "num_cpus": 0.5 * share,
            "resources": {} if self.accelerator == "GPU" else {self.accelerator: devices},
            "num_gpus": devices if self.accelerator == "GPU" else 0,
            "scheduling_strategy": self.strategy(bundle),
        }

    def release(self) -> None:
        remove_placement_group(self.group)


def create_pool(
    name: str,
    size: int,
    *,
    accelerator: str,
    devices_per_bundle: int = 1,
    timeout_s: float = 60.0,
) -> ResourcePool:
    """Reserve ``size`` bundles of ``devices_per_bundle`` devices, failing with a clear message
    when the cluster lacks them."""
    if devices_per_bundle < 1:
        raise ValueError(f"devices_per_bundle must be >= 1, got {devices_per_bundle}")
    bundles = [{"CPU": 0.5, accelerator: float(devices_per_bundle)} for _ in range(size)]
    group = placement_group(bundles, strategy="PACK", name=f"ppoflow-{name}")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        # ray's available_resources is unannotated
        available = ray.available_resources()  # type: ignore[no-untyped-call]
        raise ResourceError(
            f"pool {name!r} needs {size} bundle(s) of {{CPU: 0.5, {accelerator}: "
            f"{devices_per_bundle}}} but the cluster "
            f"has {available.get(accelerator, 0)} {accelerator} and {available.get('CPU', 0)} CPU free "
            f"after {timeout_s:.0f} s; lower resources.num_workers/rollout_workers "
            "(or rollout.tensor_parallel_size) or add devices"
        ) from None
    return ResourcePool(
        name=name,
        size=size,
        accelerator=accelerator,
        group=group,
        devices_per_bundle=devices_per_bundle,
    )
