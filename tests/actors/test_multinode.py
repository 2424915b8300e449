"""Several Ray nodes for real: Ray's own test cluster (``ray.cluster_utils.Cluster``, one raylet per node on this
machine, 2 CPUs each, one spare; a head without a dashboard, which nothing here reads), in a driver process of its
own.

On it, under dp_replicate2/tp2: each tp group stays inside a node (TOPO-5), so each replica sits on one node; the
nodes hosting ranks are asked whether they see the driver's local paths (raymoe.spec.shared_paths); then a whole node
is removed after step 4 of a run with ``max_failures=1``, and the run finishes on the node that was idle until then
(the spare: whichever node placement left free) with the last loss of the same run uninterrupted. That one runs on
this session's world of 4 (one rank thread each, as on the cluster: the same numbers), not on a second world of the
cluster: each start there is ~10 s of this test on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import raymoe
from raymoe import DistributedConfig, PackedData, Trainer, TrainerConfig

SCRIPT = textwrap.dedent(
    """
    import json, runpy, sys, time
    from pathlib import Path
    import ray
    from ray.cluster_utils import Cluster
    import raymoe
    from raymoe import DistributedConfig, Trainer
    from raymoe.spec.shared_paths import SharedPath
    test = runpy.run_path(sys.argv[1])  # this file: the run's data, layout and settings

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=2) for _ in range(3)]  # room for 4 ranks, and a spare node
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    work, checkpoint = Path(sys.argv[2]), Path(sys.argv[3])
    out = {}

    def node_of(ctx):
        return ray.get_runtime_context().get_node_id()

    layout = DistributedConfig(**test["LAYOUT"])
    with raymoe.from_pretrained(checkpoint, distributed_config=layout, placement_timeout_s=60) as model:
        nodes = model.run_on_ranks(node_of)
        # the ranks' nodes are asked for the driver's local paths: one the driver lists that they cannot see
        try:
            model.check_shared([SharedPath("output_dir", str(work), (("only-on-the-driver", 1),))])
        except ValueError as error:
            out["unseen"] = str(error)
        trainer = Trainer(model, test["run_data"](), test["run_config"](work / "interrupted", max_failures=1))
        trainer.fit(4)
        victim = next(n for n in workers if n.node_id == nodes[2])
        cluster.remove_node(victim)  # rank 2's whole node goes: its raylet and every process on it
        began = time.monotonic()
        summary = trainer.fit()
        out["recovered_in_s"] = time.monotonic() - began
        out["before_nodes"] = nodes
        out["after_nodes"] = model.run_on_ranks(node_of)
        out["victim"] = victim.node_id
        out["all_nodes"] = [n.node_id for n in workers]
        out["interrupted"] = summary.last_loss
        out["restarts"] = summary.restarts
    print("RESULT " + json.dumps(out))
    ray.shutdown()
    cluster.shutdown()
    """
)
DATA_SEED = 3
LAYOUT = {"dp_replicate_size": 2, "tp_size": 2}  # a tp pair per replica


def run_config(directory, **kw):
    """The run's settings: the cluster's interrupted run and this process's uninterrupted one."""
    return TrainerConfig(output_dir=directory, steps=8, global_batch_size=4, lr=1e-3, warmup_steps=1,
                         save_state_every=2, save_at_end=False, progress=False, **kw)  # fmt: skip


def run_data():
    return PackedData.from_rows(torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(DATA_SEED)))


@pytest.mark.slow
def test_groups_stay_on_nodes_and_a_lost_node_is_replaced_by_a_spare(tmp_path, world):
    checkpoint = raymoe.build_tiny_checkpoint(tmp_path / "tiny")
    with raymoe.from_pretrained(checkpoint, distributed_config=DistributedConfig(**LAYOUT), world=world(4)) as model:
        straight = Trainer(model, run_data(), run_config(tmp_path / "straight")).fit().last_loss
    work = tmp_path / "cluster"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, __file__, str(work), str(checkpoint)], cwd=tmp_path, capture_output=True,
        text=True, timeout=600, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    before = out["before_nodes"]  # each tp group, so each replica, inside one node; 2 of the 3 nodes used
    assert before[0] == before[1] and before[2] == before[3] and before[0] != before[2], before
    # every node hosting ranks was asked (the driver's node, the head, hosts none); the checkpoint, output_dir and
    # states of the run below passed the same question
    assert out["unseen"].count("does not see it as the driver does") == 2, out["unseen"]
    assert "(ranks 0..1)" in out["unseen"] and "(ranks 2..3)" in out["unseen"], out["unseen"]
    assert out["restarts"] == 1
    # the ranks of the lost node went to the node that was idle until then (the spare, whichever one PACK left free)
    (idle,) = set(out["all_nodes"]) - set(before)
    assert set(out["after_nodes"]) == (set(before) - {out["victim"]}) | {idle}, out
    after = out["after_nodes"]
    assert after[0] == after[1] and after[2] == after[3] and after[0] != after[2], after  # still a replica per node
    assert out["interrupted"] == pytest.approx(straight, rel=1e-6)
    print(f"node lost after step 4: the run finished {out['recovered_in_s']:.1f} s later (4 steps redone or run)")
