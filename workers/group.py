"""The Ray worker group: claims a placement group, starts one actor per rank, polls them.

`RayLauncher` implements `service.protocols.Launcher` for the controller. Resources are
claimed as one bundle per TP group (tp ranks' CPUs and GPUs), so every TP group lands on one
node and its all-reduces stay on the fast links; pipeline stages and DP replicas may span
nodes. A group moves through three phases without ever blocking the controller for long:
placing (waiting for the placement group), rendezvous (actors report their node and rank 0's
port), running (ranks train on their threads; polls drain their reports).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.protocols import NodeCapacity, PollResult
from service.spec import JobSpec
from workers.actor import RankActor

log = logging.getLogger(__name__)


def rank_env(spec: JobSpec, cpus: float) -> dict[str, str]:
    """Environment of every rank: the spec's variables over sensible thread and device defaults."""
    env = {"OMP_NUM_THREADS": str(max(1, int(cpus))), "TOKENIZERS_PARALLELISM": "false"}
    if spec.resources.gpus_per_worker == 0:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        # A NCCL error or timeout must fail the attempt instead of hanging it.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    env.update(spec.env)
    return env


class RayWorkerGroup:
    def __init__(self, *, job_id: int, attempt: int, spec: JobSpec, plan: dict[str, Any],
                 checkpoint_dir: str | None) -> None:
        layout = plan["layout"]
        self.tp = int(layout["tp"])
        self.world_size = int(plan["world_size"])
        self.spec = spec
        self.attempt = attempt
        self.checkpoint_dir = checkpoint_dir
        cpus, gpus = spec.resources.cpus_per_worker, spec.resources.gpus_per_worker
        bundle: dict[str, float] = {"CPU": cpus * self.tp}
        if gpus:
            bundle["GPU"] = float(gpus * self.tp)
        self.bundles = [dict(bundle) for _ in range(self.world_size // self.tp)]
        self.pg: PlacementGroup = placement_group(self.bundles, strategy="PACK",
                                                  name=f"trident-job{job_id}-a{attempt}")
        env = rank_env(spec, cpus)
        self.actors = [
            RankActor.options(  # type: ignore[attr-defined]
                num_cpus=cpus, num_gpus=gpus, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=r // self.tp),
            ).remote(r, self.world_size, env)
            for r in range(self.world_size)
        ]
        self.phase = "placing"
        self._info_refs: list[Any] = []
        self._infos: list[dict[str, Any]] = []
        self._poll_refs: list[Any] | None = None
        self._states: dict[int, str] = {}
        self._errors: dict[int, str] = {}

    # --- polling ----------------------------------------------------------------------------

    def poll(self, timeout_s: float) -> PollResult:
        try:
            if self.phase == "placing":
                return self._poll_placing(timeout_s)
            if self.phase == "rendezvous":
                return self._poll_rendezvous(timeout_s)
            return self._poll_running(timeout_s)
        except RayError as exc:  # errors come back as data
            return PollResult(state="failed", error=f"{type(exc).__name__}: {exc}")

    def _poll_placing(self, timeout_s: float) -> PollResult:
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            return PollResult(state="starting")
        self.phase = "rendezvous"
        self._info_refs = [a.info.remote() for a in self.actors]
        return PollResult(state="starting", events=[{
            "kind": "placement", "message": f"placement group ready: {len(self.bundles)}"
            f" bundle(s) of {self.bundles[0]} (one per TP group of {self.tp})"}])

    def _poll_rendezvous(self, timeout_s: float) -> PollResult:
        done, _ = ray.wait(self._info_refs, num_returns=len(self._info_refs), timeout=timeout_s)
        if len(done) < len(self._info_refs):
            return PollResult(state="starting")
        self._infos = ray.get(self._info_refs)
        master = self._infos[0]
        per_node: Counter[str] = Counter()
        local_ranks = []
        for info in self._infos:
            local_ranks.append(per_node[info["node_id"]])
            per_node[info["node_id"]] += 1
        ray.get([a.start.remote(self.spec.model_dump(mode="json"), master["ip"],
                                master["free_port"], local_ranks[r], self.checkpoint_dir,
                                self.attempt)
                 for r, a in enumerate(self.actors)], timeout=60)
        self.phase = "running"
        placement = {"ranks": [{k: i[k] for k in ("rank", "node_id", "ip", "pid", "gpu_ids")}
                               for i in self._infos],
                     "master": f"{master['ip']}:{master['free_port']}"}
        nodes = len(per_node)
        return PollResult(state="running", placement=placement, events=[{
            "kind": "rendezvous", "message": f"{self.world_size} ranks on {nodes} node(s);"
            f" rank 0 at {placement['master']}", "data": placement}])

    def _poll_running(self, timeout_s: float) -> PollResult:
        if self._poll_refs is None:
            self._poll_refs = [a.poll.remote() for a in self.actors]
        done, _ = ray.wait(self._poll_refs, num_returns=len(self._poll_refs), timeout=timeout_s)
        if len(done) < len(self._poll_refs):
            return PollResult(state="running")
        refs, self._poll_refs = self._poll_refs, None
        reports: list[dict[str, Any]] = []
        for r, ref in enumerate(refs):
            try:
                out = ray.get(ref)
            except RayActorError as exc:
                self._states[r] = "failed"
                self._errors[r] = f"rank {r}: actor died: {exc}"
                continue
            reports.extend(out["reports"])
            self._states[r] = out["state"]
            if out["error"]:
                self._errors[r] = f"rank {r}:\n{out['error']}"
        return PollResult(state=self._overall(), reports=reports,
                          error="\n".join(self._errors[r] for r in sorted(self._errors)) or None,
                          failed_ranks=sorted(self._errors))

    def _overall(self) -> str:
        states = set(self._states.values())
        if "failed" in states:
            return "failed"
        if states == {"succeeded"}:
            return "succeeded"
        if states <= {"succeeded", "stopped"} and "stopped" in states:
            return "stopped"
        return "running"

    # --- stopping -----------------------------------------------------------------------------

    def cancel(self) -> None:
        for a in self.actors:
            a.cancel.remote()

    def shutdown(self, grace_s: float) -> None:
        """Ask ranks to stop, wait up to `grace_s` for their threads, then kill and release."""
        self.cancel()
        if self.phase == "running":
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                try:
                    states = [s["state"] for s in ray.get([a.poll.remote() for a in self.actors],
                                                          timeout=max(0.1, grace_s))]
                except RayError:
                    break
                if "running" not in states:
                    break
                time.sleep(0.1)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
        self.phase = "closed"


class RayLauncher:
    """Starts worker groups on the Ray cluster this process is connected to."""

    def __init__(self) -> None:
        self._placing: list[RayWorkerGroup] = []

    def start(self, *, job_id: int, attempt: int, spec: JobSpec, plan: dict[str, Any],
              checkpoint_dir: str | None) -> RayWorkerGroup:
        group = RayWorkerGroup(job_id=job_id, attempt=attempt, spec=spec, plan=plan,
                               checkpoint_dir=checkpoint_dir)
        self._placing.append(group)
        return group

    def total_capacity(self) -> list[NodeCapacity]:
        from ray._private.state import total_resources_per_node  # no public per-node view

        return [NodeCapacity(n, r.get("CPU", 0.0), r.get("GPU", 0.0))
                for n, r in sorted(total_resources_per_node().items())]

    def free_capacity(self) -> list[NodeCapacity]:
        """Ray's free resources, less what groups still waiting for placement will take."""
        from ray._private.state import available_resources_per_node

        free = {n: [r.get("CPU", 0.0), r.get("GPU", 0.0)]
                for n, r in sorted(available_resources_per_node().items())}
        self._placing = [g for g in self._placing if g.phase == "placing"]
        for group in self._placing:
            for b in group.bundles:
                for cap in free.values():
                    if cap[0] >= b["CPU"] and cap[1] >= b.get("GPU", 0.0):
                        cap[0] -= b["CPU"]
                        cap[1] -= b.get("GPU", 0.0)
                        break
        return [NodeCapacity(n, c[0], c[1]) for n, c in free.items()]
