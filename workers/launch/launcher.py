"""`RayLauncher`: the controller's `service.cluster.data_plane.Launcher` on a Ray cluster.

It starts worker groups (`workers.launch.group`), re-attaches to the detached groups of a controller
that went away (by name), stops the groups no active attempt owns, and reports the cluster's
nodes and capacity. The controller connects to Ray (namespace `workers.launch.group.NAMESPACE`)
before it makes one; a launcher names its groups' ranks in that namespace unless given another
(the tests run many controllers one after another on one Ray, each in a namespace of its own).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray import PlacementGroupID
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.cluster.data_plane import NodeCapacity
from service.cluster.node_labels import node_facts
from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import CheckpointWriter
from service.files.order_cache import ServerData
from service.files.ranklogs import attempt_log_dir
from service.planner.stored import StoredPlan
from workers.launch.group import (
    JOB_GROUP_PREFIX,
    NAMESPACE,
    RANK_SUFFIX,
    RayWorkerGroup,
    cluster_probe_group,
    job_group_name,
    train_group,
    train_launch,
)

log = logging.getLogger(__name__)
INVENTORY_TIMEOUT_S = 60.0
"""How long an inventory waits for all nodes' answers together (they are asked at once)."""


@ray.remote(num_cpus=0)
def _node_inventory() -> dict[str, Any]:
    from service.cluster.inventory import node_inventory

    return node_inventory()


class RayLauncher:
    """Starts worker groups on the Ray cluster this process is connected to."""

    def __init__(self, log_root: Path | None = None, log_max_bytes: int = 16 << 20,
                 server: ServerData | None = None, light_ranks: bool = False,
                 namespace: str = NAMESPACE) -> None:
        """`log_root`: where rank logs go (`Settings.log_root`; none: not captured);
        `server`: the server's data rules the ranks keep (its sample-order cache and data
        roots; none: those of the ranks' environment); `light_ranks`: whether a job with
        `program: light` may start (`Settings.light_ranks`); `namespace`: the Ray namespace
        its groups' ranks are named in, where it starts, re-attaches and sweeps them."""
        self.namespace = namespace
        self._placing: list[RayWorkerGroup] = []
        self.log_root = log_root
        self.log_max_bytes = log_max_bytes
        self.server = server
        self.light_ranks = light_ranks
        self.cordoned: frozenset[str] = frozenset()
        """Nodes no new group is placed on (`cordon`)."""

    def cordon(self, node_ids: frozenset[str]) -> None:
        """From now on keep new groups off these nodes (and only these): their room is not
        free (`free_capacity`), and each new placement group's bundles carry a label selector
        that excludes them (Ray's `ray.io/node-id` label), so Ray itself never places a rank
        there; `trident probe` leaves them out. Groups placed already stay where they are."""
        self.cordoned = frozenset(node_ids)

    def start(self, *, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
              checkpoint_dir: str | None,
              writer: CheckpointWriter | None = None) -> RayWorkerGroup:
        """A job's attempt (`train_group`); one that fails to start has released what it
        claimed (placement group, ranks) when this raises. A job with `program: light`
        starts only where this launcher allows it (the API refuses such a job on a server
        that does not; this holds should one reach a controller that does not either)."""
        if spec.program == "light" and not self.light_ranks:
            raise ValueError("program: light: the light rank program is disabled on this"
                             " server (TRIDENT_LIGHT_RANKS)")
        group = train_group(job_id=job_id, attempt=attempt, spec=spec, plan=plan,
                            checkpoint_dir=checkpoint_dir, writer=writer,
                            log=self._rank_log(job_id, attempt), server=self.server,
                            namespace=self.namespace, avoid=self.cordoned)
        self._placing.append(group)
        return group

    def _rank_log(self, job_id: int, attempt: int) -> tuple[str, int] | None:
        if self.log_root is None:
            return None
        return str(attempt_log_dir(self.log_root, job_id, attempt)), self.log_max_bytes

    def attach(self, *, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
               checkpoint_dir: str | None,
               writer: CheckpointWriter | None = None) -> RayWorkerGroup | None:
        """The attempt's detached group, re-attached where the controller that started it
        left it: training (every rank started), or not launched yet (still waiting for its
        placement group, or placed): its polls then go on from its placement. None when it is
        gone or only some of its ranks were started, with whatever is left of it stopped."""
        name = job_group_name(job_id, attempt)
        try:
            group = RayWorkerGroup(name=name, world_size=plan.world_size,
                                   ranks_per_bundle=plan.layout.tp,
                                   cpus=spec.resources.cpus_per_worker,
                                   gpus=spec.resources.gpus_per_worker, env={}, attach=True,
                                   namespace=self.namespace,
                                   launch=train_launch(attempt=attempt, spec=spec, plan=plan,
                                                       checkpoint_dir=checkpoint_dir,
                                                       writer=writer,
                                                       log=self._rank_log(job_id, attempt),
                                                       server=self.server))
            # Until it is placed its actors cannot answer: nothing was started on them.
            placed = bool(ray.wait([group.pg.ready()], timeout=0.5)[0])
            started = ray.get([a.started.remote() for a in group.actors],
                              timeout=30) if placed else []
        except (LookupError, ValueError, RayError) as exc:
            log.info("%s: no live group to re-attach (%s)", name, exc)
            self._stop_named({name})
            return None
        if placed and all(started):
            return group
        if not any(started):  # the last controller died before it launched the ranks
            group.phase = "placing"
            self._placing.append(group)
            return group
        log.info("%s: some ranks were started, not all; stopping what is left", name)
        self._stop_named({name})
        return None

    def sweep(self, keep: set[tuple[int, int]]) -> list[str]:
        """Stop the detached job groups on the cluster but those of `keep`'s (job, attempt)
        pairs: their job finished, was cancelled or moved on while no controller watched.
        The names of the groups stopped."""
        return self._stop_named(None, {job_group_name(j, a) for j, a in keep})

    def _stop_named(self, names: set[str] | None, keep: set[str] | None = None) -> list[str]:
        """Kill the named job actors and remove the placement groups of the groups in
        `names` (None: every job group not in `keep`)."""
        def chosen(group: str) -> bool:
            return group.startswith(JOB_GROUP_PREFIX) and group not in (keep or ()) and (
                names is None or group in names)

        stopped: set[str] = set()
        for entry in ray.util.list_named_actors(all_namespaces=True):
            group = RANK_SUFFIX.sub("", entry["name"])
            if entry["namespace"] == self.namespace and chosen(group):
                with contextlib.suppress(ValueError, RayError):  # gone meanwhile
                    ray.kill(ray.get_actor(entry["name"], namespace=self.namespace),
                             no_restart=True)
                stopped.add(group)
        for pg_id, pg in ray.util.placement_group_table().items():
            if pg["state"] != "REMOVED" and chosen(pg.get("name") or ""):
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
                stopped.add(pg["name"])
        return sorted(stopped)

    def start_cluster_probe(self, *, probe_id: int, ranks_per_node: int,
                            max_bytes: int) -> RayWorkerGroup:
        """Probe every node not cordoned that can hold `ranks_per_node` ranks (one GPU each
        on GPU nodes, else a share of the node's CPUs)."""
        total = [n for n in self.total_capacity()
                 if (n.cpus > 0 or n.gpus > 0) and n.node_id not in self.cordoned]
        gpu_nodes = [n for n in total if n.gpus >= ranks_per_node]
        nodes = gpu_nodes or [n for n in total if n.cpus > 0]
        if not nodes:
            raise ValueError("no node of the cluster has CPUs or GPUs to probe with")
        gpus = 1.0 if gpu_nodes else 0.0
        cpus = min(1.0, min(n.cpus for n in nodes) / ranks_per_node)
        return cluster_probe_group(probe_id=probe_id, nodes=len(nodes),
                                   ranks_per_node=ranks_per_node, cpus=cpus, gpus=gpus,
                                   max_bytes=max_bytes, avoid=self.cordoned)

    def inventory(self) -> list[dict[str, Any]]:
        """Every live node's inventory, gathered by a zero-CPU task pinned to that node, with
        what its Ray labels declare (`service.cluster.node_labels.node_facts`: `trident node start`
        sets them)."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        refs = [_node_inventory.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
        ).remote() for n in nodes]
        out = []
        deadline = time.monotonic() + INVENTORY_TIMEOUT_S  # for all nodes: they run at once
        for n, ref in zip(nodes, refs, strict=True):
            try:
                inv = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except RayError as exc:
                inv = {"hostname": n.get("NodeManagerHostname", ""), "error": repr(exc)}
            out.append({**inv, **node_facts(inv, n.get("Labels")), "node_id": n["NodeID"],
                        "address": n.get("NodeManagerAddress"),
                        "resources": {k: v for k, v in n.get("Resources", {}).items()
                                      if k in ("CPU", "GPU", "memory")}})
        return out

    def total_capacity(self) -> list[NodeCapacity]:
        from ray._private.state import total_resources_per_node  # no public per-node view

        return [NodeCapacity(n, r.get("CPU", 0.0), r.get("GPU", 0.0))
                for n, r in sorted(total_resources_per_node().items())]

    def free_capacity(self) -> list[NodeCapacity]:
        """Ray's free resources, less what groups still waiting for placement will take;
        none on a cordoned node."""
        from ray._private.state import available_resources_per_node

        free = {n: [r.get("CPU", 0.0), r.get("GPU", 0.0)]
                for n, r in sorted(available_resources_per_node().items())
                if n not in self.cordoned}
        self._placing = [g for g in self._placing if g.phase == "placing"]
        for group in self._placing:
            for b in group.bundles:
                for cap in free.values():
                    if cap[0] >= b["CPU"] and cap[1] >= b.get("GPU", 0.0):
                        cap[0] -= b["CPU"]
                        cap[1] -= b.get("GPU", 0.0)
                        break
        return [NodeCapacity(n, c[0], c[1]) for n, c in free.items()]
