"""Resource pools on a real local Ray instance, with ``gpu_slot`` standing in for GPUs."""

from __future__ import annotations

import pytest

from infra.cluster import ResourceError, ResourcePool, create_pool


def test_pool_bundles_host_colocated_actors_and_refuse_a_third(ray_local) -> None:
    ray = ray_local

    @ray.remote
    class Holder:
        def where(self) -> str:
            return ray.get_runtime_context().get_node_id()

    pool = create_pool("colo", 1, accelerator="gpu_slot")
    try:
        # Two roles taking half a device each share the one bundle (a fake shared GPU) ...
        a = Holder.options(**pool.actor_options(0, share=0.5)).remote()
        b = Holder.options(**pool.actor_options(0, share=0.5)).remote()
        assert ray.get([a.where.remote(), b.where.remote()], timeout=60)
        # ... and a third cannot be placed: the bundle's device is fully taken.
        c = Holder.options(**pool.actor_options(0, share=0.5)).remote()
        ready, _ = ray.wait([c.where.remote()], timeout=2)
        assert ready == []
        for actor in (a, b, c):
            ray.kill(actor)
    finally:
        pool.release()


def test_pool_larger_than_the_cluster_fails_with_the_resource_named(ray_local) -> None:
    with pytest.raises(ResourceError, match="gpu_slot"):
        create_pool("too-big", 64, accelerator="gpu_slot", timeout_s=2)


def test_a_bundle_of_several_devices_gives_its_worker_all_of_them(ray_local) -> None:
    """A rollout worker of a tensor-parallel vLLM engine takes rollout.tensor_parallel_size
    devices: its bundle holds that many and the actor asks for all of them."""
    ray = ray_local

    @ray.remote
    class Holder:
        def assigned(self) -> dict[str, float]:
            return ray.get_runtime_context().get_assigned_resources()

    pool = create_pool("tp", 1, accelerator="gpu_slot", devices_per_bundle=2)
    try:
        options = pool.actor_options(0, share=1.0)
        assert options["resources"] == {"gpu_slot": 2.0}
        holder = Holder.options(**options).remote()
        assert ray.get(holder.assigned.remote(), timeout=60)["gpu_slot"] == 2.0
        ray.kill(holder)
    finally:
        pool.release()
    gpu_pool = ResourcePool("tp", 1, accelerator="GPU", group=pool.group, devices_per_bundle=4)
    assert gpu_pool.actor_options(0, share=1.0)["num_gpus"] == 4.0
    assert gpu_pool.actor_options(0, share=0.5)["num_gpus"] == 2.0
