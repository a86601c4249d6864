"""The test suite's tiers, cheapest first: every test module is in exactly one
(`tests/test_suite_rules.py`), and `tests/conftest.py` marks each of its tests with it
(`pytest -m unit`, ...). CI runs them in this order and stops at the first tier that fails
(`make test-tiers`, `.ci/run`); `make test` runs them all at once.

- unit: this process only (the store's test databases, SQLite and the local PostgreSQL, and
  the API in-process through a TestClient included): no server on a port, no other process.
- integration: servers on local ports and processes of the project or its tools (uvicorn
  in a thread, `api.serve`, the CLI as a process, MLflow's server, docker-compose, the
  controller's supervisor); no Ray, no ranks.
- physics: what the ranks compute, asserted as numbers (losses, gradients, layouts,
  checkpoints, communication attribution): torch and DeepSpeed, on ranks forked from the test
  process (`tests/forked.py`, `tests/workers_spawn.py`) or in it.
- system: the control plane end to end on real Ray and real processes: the shared Ray of
  the test process (`local_ray`), clusters of several nodes, `trident up` stacks, daemons.
- browser: the dashboard in Chromium (Playwright) against a served stack.
"""

from __future__ import annotations

import sys

TIERS: dict[str, tuple[str, ...]] = {
    "unit": (
        "test_auth_matrix", "test_budgets",
        "test_checkpoint_mapped", "test_checkpoints", "test_command_spec",
        "test_command_unplanned", "test_controller",
        "test_controller_admission",
        "test_chat_prepare", "test_command_progress", "test_controller_cancel",
        "test_controller_reattach", "test_corpus",
        "test_corpus_scan",
        "test_dashboard",
        "test_data_metrics", "test_data_spec", "test_elastic", "test_exports", "test_goodput",
        "test_heap",
        "test_heartbeats",
        "test_memory_gap", "test_metrics_ingest", "test_monitor_health", "test_monitor_links",
        "test_monitor_report",
        "test_node_cordon",
        "test_node_survey",
        "test_order_cache", "test_pace", "test_plan_api", "test_planner",
        "test_planner_calibration", "test_planner_clusters", "test_planner_fit",
        "test_planner_moves", "test_planner_published", "test_profile",
        "test_planner_sac", "test_planner_uneven", "test_preempting", "test_prometheus",
        "test_quota", "test_ray_env", "test_repository", "test_reported_views", "test_rescaling",
        "test_sample_order",
        "test_scheduler", "test_session", "test_spec", "test_store_engine", "test_stored_step",
        "test_strict_input", "test_suite_rules", "test_tag_steps", "test_tracking_export",
        "test_tracking_scalars",
    ),
    "integration": (
        "test_api", "test_api_properties", "test_api_workers", "test_auth", "test_bench",
        "test_cli", "test_cli_errors", "test_cli_goodput", "test_cli_jobs", "test_cli_logs",
        "test_cli_views",
        "test_client", "test_command_rank", "test_compare", "test_compose", "test_confine",
        "test_data_cost",
        "test_datadir", "test_dbcheck", "test_gpu_check", "test_healthcheck", "test_imports",
        "test_lease", "test_light_rank", "test_migrations_drift", "test_node",
        "test_node_cordon_cli", "test_secrets",
        "test_spec_files", "test_stacks", "test_store", "test_supervisor",
        "test_tracking_mlflow",
    ),
    "physics": (
        "test_bench_checkpoint", "test_chat_training", "test_checkpoint_async",
        "test_checkpoint_integrity", "test_command_scripts",
        "test_deepspeed_import", "test_document_masks", "test_ds_config",
        "test_export_memory", "test_hf_config", "test_hf_models", "test_layout_free",
        "test_layout_free_form",
        "test_layout_free_memory",
        "test_monitor_gpu", "test_monitor_hang", "test_monitor_misc", "test_monitor_probe",
        "test_monitor_timer", "test_plan_agreement", "test_planner_deepspeed", "test_preemption",
        "test_profile_rank",
        "test_resubmit_checkpoint", "test_retention", "test_workers_bubble",
        "test_workers_checkpoint_owner", "test_workers_construction", "test_workers_data",
        "test_workers_entrypoints", "test_workers_faults", "test_workers_layouts",
        "test_workers_recipe", "test_workers_rendezvous", "test_workers_tp",
        "test_workers_train", "test_workers_units", "test_guards", "test_workers_compile",
    ),
    "system": (
        "test_budgets_ray", "test_calibration_ray", "test_checkpoint_ray", "test_cli_ray",
        "test_command_hf_ray", "test_command_ray",
        "test_cli_views_ray",
        "test_controller_cli", "test_e2e_damaged_db", "test_e2e_data", "test_e2e_detached",
        "test_e2e_exports", "test_e2e_full_disk", "test_export_ray", "test_e2e_leader",
        "test_e2e_loopback",
        "test_e2e_one_stack", "test_e2e_ray", "test_elastic_ray", "test_hosts_faults",
        "test_e2e_stop", "test_goodput_ray", "test_goodput_views_ray", "test_guards_ray",
        "test_hosts_jobs", "test_hosts_links", "test_node_cordon_ray", "test_node_loss_ray",
        "test_node_ray",
        "test_placement_ray", "test_plan_agreement_ray",
        "test_preemption_ray", "test_profile_ray", "test_ranklogs", "test_stacks_ray",
        "test_tag_steps_ray",
        "test_tracking_e2e",
    ),
    "browser": ("test_browser",),
}
"""Each tier's test modules (their names under tests/)."""


def tier_of(module: str) -> str | None:
    """The tier of test module `module` (its name), None when it is in none."""
    found = [tier for tier, modules in TIERS.items() if module in modules]
    return found[0] if len(found) == 1 else None


def main(argv: list[str]) -> int:
    """`python -m tests.tiers TIER`: the paths of the tier's test modules, one line, for
    pytest to collect only them."""
    if len(argv) != 1 or argv[0] not in TIERS:
        print(f"usage: python -m tests.tiers {{{','.join(TIERS)}}}", file=sys.stderr)
        return 2
    print(" ".join(f"tests/{m}.py" for m in TIERS[argv[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
