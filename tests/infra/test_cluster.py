"""Resource pools on a real local Ray instance, with ``gpu_slot`` standing in for GPUs."""

from __future__ import annotations

import pytest

from infra.cluster import ResourceError, create_pool


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
