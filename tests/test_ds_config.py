"""The spec's `deepspeed:` section (`service.contract.ds_config`): allowed keys pass through to the
config the ranks give `deepspeed.initialize`, which `trident plan --deepspeed-config` prints;
a key the spec decides is refused unless it repeats the spec's value, naming the key and the
spec field; any other key is refused with the allow list."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from api.app import create_app
from cli.main import app
from service.contract.ds_config import deepspeed_config
from service.contract.spec import JobSpec
from service.settings import Settings
from service.store import Store
from tests.conftest import authed_client, tiny_spec
from tests.workers_spawn import run_ranks

BASE = {"name": "ds", "model": {"preset": "gpt-tiny"},
        "parallel": {"dp": 2, "zero": 2}, "train": {"global_batch": 8, "precision": "fp32"}}
TUNING = {"zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 12345678,
                                "contiguous_gradients": True, "stage": 2},
          "communication_data_type": "fp32", "train_batch_size": 8}


@pytest.mark.parametrize("section, field, names", [
    ({"train_batch_size": 16}, "deepspeed.train_batch_size", "train.global_batch"),
    ({"zero_optimization": {"stage": 3}}, "deepspeed.zero_optimization.stage", "parallel.zero"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "deepspeed.zero_optimization.offload_optimizer", "parallel.offload"),
    ({"bf16": {"enabled": True}}, "deepspeed.bf16", "train.precision"),
    ({"gradient_clipping": 0.5}, "deepspeed.gradient_clipping", "train.grad_clip"),
    ({"optimizer": {"type": "SGD"}}, "deepspeed.optimizer", "train.lr"),
    ({"gradient_accumulation_steps": 1}, "deepspeed.gradient_accumulation_steps",
     "train.micro_batch"),
])
def test_a_key_that_contradicts_the_spec_is_refused_naming_both(section, field, names):
    with pytest.raises(ValueError) as err:
        JobSpec.model_validate({**BASE, "deepspeed": section})
    msg = str(err.value)
    assert f"{field}: " in msg and names in msg, msg


def test_an_unknown_key_is_refused_with_the_allow_list_and_a_layout_key_needs_a_layout():
    with pytest.raises(ValueError, match=r"deepspeed\.zero_force_ds_cpu_optimizer: .*allowed:"
                                         r" communication_data_type"):
        JobSpec.model_validate({**BASE, "deepspeed": {"zero_force_ds_cpu_optimizer": True}})
    with pytest.raises(ValueError, match=r"deepspeed\.zero_optimization\.ignore_unused: .*"
                                         r"allowed: allgather_bucket_size"):
        JobSpec.model_validate({**BASE, "deepspeed": {"zero_optimization": {
            "ignore_unused": True}}})
    with pytest.raises(ValueError, match="layout is 'auto'"):
        JobSpec.model_validate({**BASE, "parallel": "auto", "deepspeed": {"train_batch_size": 8},
                                "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 2}})
    with pytest.raises(ValueError, match="deepspeed"):  # bounded, as every field
        JobSpec.model_validate({**BASE, "deepspeed": {f"k{i}": 1 for i in range(65)}})


def test_the_api_refuses_a_contradiction_with_a_422(store: Store, tmp_path) -> None:
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as client:
        r = client.post("/api/v1/jobs", json=tiny_spec(deepspeed={"train_batch_size": 1000}))
        assert r.status_code == 422
        [d] = r.json()["detail"]
        assert d["loc"] == ["body", "deepspeed", "train_batch_size"], d
        assert "train_batch_size=1000 contradicts train.global_batch" in d["msg"], d
        ok = tiny_spec(deepspeed={"zero_optimization": {"overlap_comm": True}})
        assert client.post("/api/v1/jobs", json=ok).status_code == 201


@pytest.mark.slow
def test_allowed_keys_reach_deepspeed_and_the_printed_config_is_the_ranks(tmp_path,
                                                                         monkeypatch):
    spec = JobSpec.model_validate({**BASE, "deepspeed": TUNING,
                                   "entrypoint": "tests.entrypoints:ds_config_dump"})
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json())
    out = CliRunner().invoke(app, ["plan", str(path), "--deepspeed-config"])
    assert out.exit_code == 0, out.output
    printed = json.loads(out.output)
    assert printed == deepspeed_config(spec)
    assert printed["zero_optimization"] == {"overlap_comm": True, "reduce_bucket_size": 12345678,
                                            "contiguous_gradients": True, "stage": 2}
    dump = tmp_path / "ds.json"
    monkeypatch.setenv("TRIDENT_TEST_DS_CONFIG", str(dump))
    run_ranks(spec.model_copy(update={"env": {"TRIDENT_TEST_DS_CONFIG": str(dump)}}))
    ranks = json.loads(dump.read_text())
    assert ranks["config"] == printed
    assert ranks["engine"] == {"reduce_bucket_size": 12345678, "overlap_comm": True,
                               "communication_data_type": "torch.float32"}


PROBES = [True, False, None, 0, 1, -1, 5e8, 12345678, 2.5, float("nan"), "fp16", "BF16",
          "int8", "true", "7", [1], 10**12]
"""Values a user might write for any key: DeepSpeed's own checks and Trident's are held
against each other on each."""


def test_every_value_trident_lets_through_is_one_deepspeed_takes() -> None:
    # Trident's rules (service.contract.ds_config.VALUES, the service imports no deepspeed) against
    # DeepSpeed's own: its ZeRO config model, and its reading of the communication dtypes.
    from deepspeed.runtime.config import get_communication_data_type
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from service.contract.ds_config import ALLOWED_ZERO, value_refusal

    def deepspeed_takes(key: str, value: object) -> bool:
        try:
            if key.startswith("zero_optimization."):
                DeepSpeedZeroConfig(**{key.split(".", 1)[1]: value})
            else:
                get_communication_data_type({key: value}, key, None)
        except Exception:
            return False
        return True

    keys = [f"zero_optimization.{k}" for k in sorted(ALLOWED_ZERO)] + [
        "communication_data_type", "seq_parallel_communication_data_type"]
    for key in keys:
        ours = {repr(v): value_refusal(key, v) is None for v in PROBES}
        theirs = {repr(v): deepspeed_takes(key, v) for v in PROBES}
        assert [v for v in ours if ours[v] and not theirs[v]] == [], key  # never looser
        assert any(ours.values()) and not all(theirs.values()), (key, theirs)


@pytest.mark.parametrize("section, field, why", [
    ({"zero_optimization": {"reduce_bucket_size": 0}},
     ["deepspeed", "zero_optimization", "reduce_bucket_size"], "a whole number of at least 1"),
    ({"zero_optimization": {"allgather_bucket_size": -5}},
     ["deepspeed", "zero_optimization", "allgather_bucket_size"], "at least 0"),
    ({"zero_optimization": {"overlap_comm": "yes please"}},
     ["deepspeed", "zero_optimization", "overlap_comm"], "must be true or false"),
    ({"communication_data_type": "int8"}, ["deepspeed", "communication_data_type"],
     "fp16, bf16, fp32 or null"),
    ({"gradient_predivide_factor": 0}, ["deepspeed", "gradient_predivide_factor"],
     "a number above 0"),
    ({"steps_per_print": 0}, ["deepspeed", "steps_per_print"], "at least 1"),
])
def test_a_value_deepspeed_refuses_is_a_422_naming_the_key(
        store: Store, tmp_path, section: dict, field: list[str], why: str) -> None:
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as client:
        r = client.post("/api/v1/jobs", json=tiny_spec(deepspeed=section))
        assert r.status_code == 422, r.text
        [d] = r.json()["detail"]
        assert d["loc"] == ["body", *field] and why in d["msg"], d
        good = {"zero_optimization": {"reduce_bucket_size": 5e8, "overlap_comm": None},
                "communication_data_type": "bf16", "steps_per_print": 10}
        assert client.post("/api/v1/jobs", json=tiny_spec(deepspeed=good)).status_code == 201
