"""The Ray worker group: claims a placement group, starts one actor per rank, polls them.

`workers.launch.launcher.RayLauncher` starts these groups for the controller. Resources are
claimed as one bundle per TP group (tp ranks' CPUs and GPUs), so every TP group lands on one
node and its all-reduces stay on the fast links; pipeline stages and DP replicas may span
nodes. A group moves through four phases without ever blocking the controller for long:
placing (waiting for the placement group), rendezvous (actors report their node and rank 0's
port), launching (ranks import their libraries and start their threads), running (ranks
train on their threads; polls drain their reports). `shutdown` may block for the grace: the
controller runs it beside its loop (`service.control.teardown`).
One module because it is one group's life from its placement to its shutdown, with the
questions the controller asks all of its actors at once (stacks, profiles) beside it.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import ray
from pydantic import ValidationError
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    PlacementGroupSchedulingStrategy,
)

from service.cluster.data_plane import GroupState, PollResult
from service.contract.reports import HeartbeatReport
from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import CheckpointWriter
from service.files.order_cache import ServerData
from service.planner.stored import StoredPlan
from workers.rank.actor import RankActor, rank_runtime_env
from workers.runtime import nccl_env
from workers.runtime.command_env import NodePlace
from workers.runtime.ranklog import secret_names_env

log = logging.getLogger(__name__)


def rank_env(spec_env: dict[str, str], cpus: float, gpus: float) -> dict[str, str]:
    """Environment of every rank: the spec's variables over thread and device defaults and,
    on GPUs, NCCL settings that make an error or timeout fail the attempt, not hang it."""
    env = {"OMP_NUM_THREADS": str(max(1, int(cpus))), "TOKENIZERS_PARALLELISM": "false"}
    if gpus == 0:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(nccl_env.rank_env(spec_env, on_gpu=gpus > 0))
    return env


NAMESPACE = "trident"
"""Ray namespace of the controller and of every group it names (the default of a launcher's:
`workers.launch.launcher.RayLauncher`; the tests give each launcher on a shared Ray one of its
own)."""


def rank_actor_name(group: str, rank: int) -> str:
    return f"{group}-r{rank}"


class RayWorkerGroup:
    """The ranks of one attempt (or of one cluster probe) and their placement group.

    A job's group is detached and named (`trident-job<id>-a<attempt>`, its ranks `...-r<rank>`)
    in the `trident` namespace (`namespace`): it lives on when the controller's process ends,
    and a new controller re-attaches to it by name (`RayLauncher.attach`). Only `shutdown`
    ends it. Its placement group is named in the driver's namespace (Ray names placement
    groups there): the controller's, which is `NAMESPACE` too.
    """

    def __init__(self, *, name: str, world_size: int, ranks_per_bundle: int, cpus: float,
                 gpus: float, env: dict[str, str], strategy: str = "PACK",
                 launch: Callable[[Any, int, list[dict[str, Any]], int], Any] | None,
                 detached: bool = False, attach: bool = False,
                 namespace: str = NAMESPACE, avoid: Collection[str] = ()) -> None:
        self.name = name
        self.world_size = world_size
        self.tp = ranks_per_bundle
        self._launch = launch
        bundle: dict[str, float] = {"CPU": cpus * ranks_per_bundle}
        if gpus:
            bundle["GPU"] = float(gpus * ranks_per_bundle)
        self.bundles = [dict(bundle) for _ in range(world_size // ranks_per_bundle)]
        self.phase = "placing"
        self.infos: list[dict[str, Any]] = []
        self._info_refs: list[Any] = []
        self._launch_refs: list[Any] = []
        self._placement: dict[str, Any] = {}
        self._poll_refs: dict[int, Any] = {}
        self._states: dict[int, str] = {}
        self._errors: dict[int, str] = {}
        self._acked: dict[int, int] = {}
        self._bad_beats: set[int] = set()
        self.actors: list[Any]
        if attach:  # the ranks exist and train: look them up by name
            found = get_placement_group(name)
            if found is None:
                raise LookupError(f"no placement group {name}")
            self.pg = found
            self.actors = [ray.get_actor(rank_actor_name(name, r), namespace=namespace)
                           for r in range(world_size)]
            self.phase = "running"
            return
        lifetime = {"lifetime": "detached"} if detached else {}
        self.pg = placement_group(self.bundles, strategy=strategy, name=name, **lifetime,
                                  bundle_label_selector=avoiding(avoid, len(self.bundles)))
        self.actors = []
        try:
            for r in range(world_size):
                self.actors.append(RankActor.options(  # type: ignore[attr-defined]
                    num_cpus=cpus, num_gpus=gpus, runtime_env=rank_runtime_env(),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=r // self.tp),
                    **({"name": rank_actor_name(name, r), "namespace": namespace, **lifetime}
                       if detached else {}),
                ).remote(r, world_size, env))
        except BaseException:
            # A partial start releases what it claimed now, not at the next controller's
            # sweep: the ranks made so far and the placement group.
            try:
                self._release()
            except RayError:
                log.exception("%s: releasing what a failed start claimed failed", name)
            raise

    # --- polling ----------------------------------------------------------------------------

    def poll(self, timeout_s: float) -> PollResult:
        try:
            if self.phase == "placing":
                return self._poll_placing(timeout_s)
            if self.phase == "rendezvous":
                return self._poll_rendezvous(timeout_s)
            if self.phase == "launching":
                return self._poll_launching(timeout_s)
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
            f" bundle(s) of {self.bundles[0]} ({self.tp} rank(s) each, on one node)"}])

    def _poll_rendezvous(self, timeout_s: float) -> PollResult:
        done, _ = ray.wait(self._info_refs, num_returns=len(self._info_refs), timeout=timeout_s)
        if len(done) < len(self._info_refs):
            return PollResult(state="starting")
        self.infos = ray.get(self._info_refs)
        per_node: Counter[str] = Counter()
        local_ranks = []
        for info in self.infos:
            local_ranks.append(per_node[info["node_id"]])
            per_node[info["node_id"]] += 1
        # Starting a rank imports its libraries (seconds): waited for by later polls.
        assert self._launch is not None
        self._launch_refs = [self._launch(a, r, self.infos, local_ranks[r])
                             for r, a in enumerate(self.actors)]
        self.phase = "launching"
        master = self.infos[0]
        keys = ("rank", "node_id", "hostname", "ip", "pid", "nice", "gpu_ids")
        self._placement = {"ranks": [{k: i[k] for k in keys} for i in self.infos],
                           "master": f"{master['ip']}:{master['free_ports'][0]}"}
        return self._poll_launching(timeout_s)

    def _poll_launching(self, timeout_s: float) -> PollResult:
        refs = self._launch_refs
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(done) < len(refs):
            return PollResult(state="starting")
        ray.get(refs)  # a rank that failed to start raises here: a failed poll
        self.phase = "running"
        placement = self._placement
        nodes = len({r["node_id"] for r in placement["ranks"]})
        events = [{"kind": "rendezvous", "message": f"{self.world_size} ranks on"
                   f" {nodes} node(s); rank 0 at {placement['master']}", "data": placement}]
        return PollResult(state="running", placement=placement, events=events)

    def _poll_running(self, timeout_s: float) -> PollResult:
        # One outstanding poll per rank: a rank whose actor does not answer (its training
        # thread holding the interpreter in a stuck collective) must not hide the others'
        # news, such as a peer that failed.
        for r, a in enumerate(self.actors):
            if r not in self._poll_refs:
                self._poll_refs[r] = a.poll.remote(self._acked.get(r, 0))
        refs = list(self._poll_refs.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done_set = set(done)
        reports: list[dict[str, Any]] = []
        heartbeats: dict[int, HeartbeatReport] = {}
        acks: dict[int, int] = {}
        events: list[dict[str, Any]] = []
        for r, ref in list(self._poll_refs.items()):
            if ref not in done_set:
                continue
            del self._poll_refs[r]
            try:
                out = ray.get(ref)
            except RayActorError as exc:
                self._states[r] = "failed"
                self._errors[r] = f"rank {r}: actor died: {exc}"
                continue
            for report in out["reports"]:
                acks[r] = max(acks.get(r, 0), report.pop("seq"))
                reports.append(report)
            if out.get("dropped"):
                events.append({"kind": "warning", "message": f"rank {r} dropped"
                               f" {out['dropped']} unacknowledged report(s): its buffer is full"})
            try:
                heartbeats[r] = HeartbeatReport.model_validate(out["heartbeat"])
            except ValidationError as exc:  # dropped, said once: the rank is judged without it
                if r not in self._bad_beats:
                    self._bad_beats.add(r)
                    events.append({"kind": "warning", "message": f"rank {r} sent a heartbeat"
                                   f" that does not validate, dropped: {exc}"})
            self._states[r] = out["state"]
            if out["error"]:
                self._errors[r] = f"rank {r}:\n{out['error']}"
        return PollResult(state=self._overall(), reports=reports, heartbeats=heartbeats,
                          error="\n".join(self._errors[r] for r in sorted(self._errors)) or None,
                          failed_ranks=sorted(self._errors), acks=acks, events=events)

    def acknowledge(self, acks: dict[int, int]) -> None:
        """The reports up to these sequence numbers are stored: the ranks may forget them
        (with the next poll of each rank)."""
        for r, seq in acks.items():
            self._acked[r] = max(self._acked.get(r, 0), seq)

    def _overall(self) -> GroupState:
        states = set(self._states.values())
        if "failed" in states:
            return "failed"
        if len(self._states) < self.world_size:
            return "running"
        if states == {"succeeded"}:
            return "succeeded"
        if states <= {"succeeded", "stopped"} and "stopped" in states:
            return "stopped"
        return "running"

    def stacks(self, timeout_s: float = 10.0) -> dict[int, str]:
        """Every rank's Python stacks (all threads); ranks that do not answer say so."""
        return self._ask_all([a.stacks.remote() for a in self.actors], timeout_s)

    def thread_stacks(self, timeout_s: float, max_bytes: int) -> dict[int, Any]:
        """`trident stacks`: per rank its threads' stacks (`RankActor.thread_stacks`), or a
        string saying why there are none (no answer within `timeout_s`, actor gone)."""
        return self._ask_all([a.thread_stacks.remote(max_bytes) for a in self.actors],
                             timeout_s)

    def profile(self, request_id: int, *, ranks: list[int], steps: int, memory: bool,
                max_bytes: int, timeout_s: float) -> dict[int, Any]:
        """`trident profile`: the named ranks profile the same `steps` steps, from the second
        step to start after the furthest of them is at now (`RankActor.profile`); per rank its
        answer (`workers.monitor.profiler.StepProfiler.result`) or why there is none."""
        deadline = time.monotonic() + timeout_s
        actors = {r: self.actors[r] for r in ranks}
        now = self._ask_all([a.step.remote() for a in actors.values()], 10.0)
        start = max((s for s in now.values() if isinstance(s, int)), default=0) + 2
        out: dict[int, Any] = {}
        armed = self._ask_all([a.profile.remote(request_id, steps, memory, start, max_bytes)
                               for a in actors.values()], 10.0)
        waiting = {}
        for i, (r, a) in enumerate(actors.items()):
            if armed[i] is None:
                waiting[r] = a
            else:
                out[r] = armed[i]
        while waiting and time.monotonic() < deadline:
            answers = self._ask_all([a.profile_result.remote(request_id)
                                     for a in waiting.values()], 10.0)
            for i, r in enumerate(list(waiting)):
                if isinstance(answers[i], dict) or str(answers[i]).startswith("(actor gone"):
                    out[r] = answers[i]
                    del waiting[r]
            time.sleep(0.5)
        for r in waiting:
            out[r] = f"(no trace within {timeout_s:g} s: the steps did not end)"
        return out

    def _ask_all(self, refs: list[Any], timeout_s: float) -> dict[int, Any]:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out: dict[int, Any] = {}
        for r, ref in enumerate(refs):
            try:
                out[r] = ray.get(ref, timeout=0) if ref in ready else "(no answer)"
            except RayError as exc:
                out[r] = f"(actor gone: {type(exc).__name__})"
        return out

    # --- stopping -----------------------------------------------------------------------------

    def cancel(self, grace_s: float | None = None) -> None:
        """Ask every rank to stop; a command's process is killed once `grace_s` is over."""
        for a in self.actors:
            a.cancel.remote(grace_s)

    def preempt(self) -> None:
        """Ask every rank to checkpoint at the next step boundary and stop there."""
        for a in self.actors:
            a.preempt.remote()

    def shutdown(self, grace_s: float) -> None:
        """Ask ranks to stop, wait up to `grace_s` for their threads, then kill and release.
        A command's process gets most of the grace (`COMMAND_GRACE_SHARE`), so that the rank
        kills it before its actor is killed."""
        self.cancel(grace_s * COMMAND_GRACE_SHARE)
        if self.phase == "running":
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                try:
                    states = [s["state"] for s in ray.get(
                        [a.poll.remote() for a in self.actors],
                        timeout=max(0.1, deadline - time.monotonic()))]
                except RayError:
                    break
                if "running" not in states:
                    break
                time.sleep(0.1)
        self._release()

    def _release(self) -> None:
        """Kill the ranks and remove the placement group."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
        self.phase = "closed"


COMMAND_GRACE_SHARE = 0.8
"""The share of a shutdown's grace a command's process gets between SIGTERM and SIGKILL."""


def train_launch(*, attempt: int, spec: JobSpec, plan: StoredPlan, checkpoint_dir: str | None,
                 log: tuple[str, int] | None, writer: CheckpointWriter | None = None,
                 server: ServerData | None = None,
                 ) -> Callable[[Any, int, list[dict[str, Any]], int], Any]:
    """How a job's group starts each rank once its ranks met (`RayWorkerGroup`'s `launch`):
    with the job's stored spec and the rank's row of its stored plan (`StoredPlan.rank_plan`:
    its stage, layers and groups); `writer`: the job the checkpoint folder must belong to;
    `server`: the server's data rules (its sample-order cache and data roots)."""
    writer_json = writer.to_json() if writer is not None else None
    server_json = server.to_json() if server is not None else None

    def launch(actor: Any, rank: int, infos: list[dict[str, Any]], local_rank: int) -> Any:
        node = NodePlace.of(rank, [i["node_id"] for i in infos]).to_json()
        return actor.start.remote(spec, plan.rank_plan(rank), infos[0]["ip"],
                                  infos[0]["free_ports"], local_rank, checkpoint_dir, attempt,
                                  log, writer_json, server_json, node)

    return launch


def avoiding(nodes: Collection[str], bundles: int) -> list[dict[str, str]] | None:
    """Ray's bundle label selectors that keep every bundle off `nodes` (cordoned: their
    ids, by Ray's `ray.io/node-id` label); None when there are none to avoid."""
    if not nodes:
        return None
    return [{NODE_ID_LABEL_KEY: f"!in({','.join(sorted(nodes))})"} for _ in range(bundles)]


def train_group(*, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
                checkpoint_dir: str | None, writer: CheckpointWriter | None = None,
                log: tuple[str, int] | None = None,
                server: ServerData | None = None,
                namespace: str = NAMESPACE, avoid: Collection[str] = ()) -> RayWorkerGroup:
    """A job's attempt: one bundle per TP group, ranks probe (if asked) and train; with
    `log` (directory, cap per rank) each rank's stdout and stderr go to a file there; its
    ranks named in `namespace`, placed on no node of `avoid` (cordoned)."""
    cpus, gpus = spec.resources.cpus_per_worker, spec.resources.gpus_per_worker
    return RayWorkerGroup(name=job_group_name(job_id, attempt), world_size=plan.world_size,
                          ranks_per_bundle=plan.layout.tp, cpus=cpus, gpus=gpus,
                          # The job's secrets reach the ranks' environment only: the
                          # spec each rank is sent (`train_launch`, a dump) carries none;
                          # their names tell the rank logs what to redact.
                          env=rank_env({**spec.env, **spec.secret_values(),
                                        **secret_names_env(spec.secrets)}, cpus, gpus),
                          detached=True, namespace=namespace, avoid=avoid,
                          launch=train_launch(attempt=attempt, spec=spec, plan=plan,
                                              writer=writer, server=server,
                                              checkpoint_dir=checkpoint_dir, log=log))


def job_group_name(job_id: int, attempt: int) -> str:
    return f"{JOB_GROUP_PREFIX}{job_id}-a{attempt}"


JOB_GROUP_PREFIX = "trident-job"
RANK_SUFFIX = re.compile(r"-r\d+$")


def cluster_probe_group(*, probe_id: int, nodes: int, ranks_per_node: int, cpus: float,
                        gpus: float, max_bytes: int,
                        avoid: Collection[str] = ()) -> RayWorkerGroup:
    """`trident probe`: one bundle per node (strictly spread), ranks_per_node ranks each,
    none on the nodes of `avoid` (cordoned)."""

    def launch(actor: Any, rank: int, infos: list[dict[str, Any]], local_rank: int) -> Any:
        return actor.start_cluster_probe.remote(infos[0]["ip"], infos[0]["free_ports"][0],
                                                ranks_per_node, max_bytes)

    return RayWorkerGroup(name=f"trident-probe{probe_id}", world_size=nodes * ranks_per_node,
                          ranks_per_bundle=ranks_per_node, cpus=cpus, gpus=gpus,
                          env=rank_env({}, cpus, gpus),
                          strategy="STRICT_SPREAD" if nodes > 1 else "PACK", launch=launch,
                          avoid=avoid)
