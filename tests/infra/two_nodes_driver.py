"""The driver of tests/infra/test_two_nodes.py, run inside the Ray head's network namespace:
``python two_nodes_driver.py ROOT POLICY TOKENIZER HEAD:PORT IFNAME``. Prints one ``RESULT {...}``
line: per data-parallel size, the nodes its workers ran on, their weight digests and the
update's metrics. ``HEAD:PORT`` may be ``local``: one node with two slots."""

from __future__ import annotations

import json
import sys


def main(root: str, policy: str, tokenizer: str, address: str, ifname: str) -> dict[int, object]:
    sys.path.insert(0, root)
    from dataclasses import replace

    import ray
    import torch
    from transformers import AutoTokenizer

    from infra.cluster import create_pool
    from infra.config import load_config
    from infra.group import WorkerGroup
    from infra.workers import ModelWorker, WorkerSpec
    from storage import BatchMeta, open_store
    from tasks.generate.stage import generate_rows, sample_meta
    from tasks.io import nested, rows
    from tasks.update.stage import actor_settings, combine_worker_metrics, update_rows

    env = {"PYTHONPATH": root, "GLOO_SOCKET_IFNAME": ifname}
    if address == "local":  # one node with two slots: the same run without a second node
        ray.init(address="local", num_cpus=4, resources={"gpu_slot": 2}, include_dashboard=False)
    else:
        ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env})
    cfg = load_config(
        None,
        [
            "rollout.max_new_tokens=4",
            "rollout.n=2",
            "actor.lr=1e-3",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=4",
        ],
    )
    store = open_store("ray://two-nodes?shards=1")

    def spec(roles: tuple[str, ...]) -> WorkerSpec:
        return WorkerSpec(
            roles=roles, cfg=cfg, policy_path=policy, tokenizer_path=tokenizer, store_url=store.url
        )

    # 1. Prompts, responses (one rollout worker), advantages.
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids = [
        torch.tensor(
            tok.apply_chat_template(
                [{"role": "user", "content": f"{10 + i}+{20 + i}="}],
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for i in range(4)
    ]
    prompts = BatchMeta("two/1", tuple(f"p{i}/0" for i in range(4)))
    samples = sample_meta(prompts, 2)
    keys = list(samples.keys)
    store.kv_batch_put(keys, "two/1", {"prompt_ids": nested([p for p in ids for _ in range(2)])})
    pool = create_pool("gen", 1, accelerator="gpu_slot")
    gen = WorkerGroup(pool, spec(("rollout",)), call_timeout_s=300)
    gen.run_on(0, generate_rows, prompts, n=2, seed=3, first_group=0)
    gen.shutdown()
    pool.release()
    responses = store.kv_batch_get(keys, "two/1", ["response_ids"])["response_ids"]
    torch.manual_seed(0)
    advantages = nested([torch.randn(len(r)) for r in rows(responses)])
    store.kv_batch_put(keys, "two/1", {"advantages": advantages})
    # 2. The same update by one worker and by two (one per node when each node has one slot).
    out: dict[int, object] = {}
    for size in (1, 2):
        pool = create_pool(f"dp{size}", size, accelerator="gpu_slot")
        group = WorkerGroup(pool, spec(("actor",)), call_timeout_s=300)
        nodes = group.run(node_address)
        metrics = combine_worker_metrics(
            group.run_sharded(
                update_rows,
                samples,
                step=0,
                reads=("prompt_ids", "response_ids", "rollout_logprobs", "advantages"),
                # π_old: the rollout's log-probs
                actor=replace(actor_settings(cfg, size), old_is_rollout=True),
                critic=None,
            )
        )
        digest = group.call(ModelWorker.parameters_digest)
        out[size] = {"nodes": nodes, "digest": digest, "metrics": metrics}
        group.shutdown()
        pool.release()
    store.close()
    return out


def node_address(worker: object) -> str:
    """Worker side: the address of the node this worker runs on."""
    import ray

    return str(ray.util.get_node_ip_address())


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(*sys.argv[1:6])), flush=True)
