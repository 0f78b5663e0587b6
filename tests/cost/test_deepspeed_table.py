"""labkit.deepspeed: the ZeRO key table, the JSON config builder and the pipeline rule. The
builder's offload rules agree with labkit.placement's (the memory model); every FSDP2 option the
table names exists in the torch installed; every key a config holds is in the table."""
from __future__ import annotations

import inspect
import itertools
import json
import re

import pytest

from labkit.deepspeed import (KEYS, PIPELINE_WHY, check_pipeline, deepspeed_config, key_rows)
from labkit.placement import check_placement

ZERO_KEYS = {k.key: k for k in KEYS}


def _paths(section: dict, prefix: str = "") -> list[str]:
    out = []
    for name, value in section.items():
        path = f"{prefix}{name}"
        out += _paths(value, path + ".") if isinstance(value, dict) else [path]
    return out


COMBOS = list(itertools.product((0, 1, 2, 3), (False, "cpu", "nvme"), (False, "cpu", "nvme")))


def _config_or_none(stage, opt, par):
    try:
        return deepspeed_config(stage, offload_optimizer=opt, offload_param=par)
    except ValueError:
        return None


@pytest.mark.parametrize("stage, opt, par", COMBOS)
def test_every_key_of_a_config_is_in_the_table_for_its_stage(stage, opt, par):
    config = _config_or_none(stage, opt, par)
    if config is None:
        return
    assert json.loads(json.dumps(config)) == config          # plain JSON
    assert config["zero_optimization"]["stage"] == stage
    for path in _paths(config["zero_optimization"]):
        if path.endswith("nvme_path"):
            continue
        assert path in ZERO_KEYS, path
        assert stage in ZERO_KEYS[path].stages, (path, stage)


def test_stage_specific_keys():
    z1 = deepspeed_config(1)["zero_optimization"]
    z3 = deepspeed_config(3)["zero_optimization"]
    assert not any(k.startswith("stage3_") for k in z1) and "allgather_bucket_size" in z1
    assert "stage3_prefetch_bucket_size" in z3 and "allgather_bucket_size" not in z3
    assert deepspeed_config(0)["zero_optimization"] == {"stage": 0}
    assert "bf16" in deepspeed_config(2) and "fp16" in deepspeed_config(2, precision="fp16")
    assert not {"bf16", "fp16"} & set(deepspeed_config(2, precision="fp32"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("opt, par, placement", [(True, False, "optimizer"),
                                                 (True, True, "params")])
def test_offload_rules_agree_with_the_memory_model(stage, opt, par, placement):
    """deepspeed_config accepts an offload exactly where estimate_memory(offload=...) does."""
    def accepted(fn):
        try:
            fn()
        except ValueError:
            return False
        return True
    assert accepted(lambda: deepspeed_config(stage, opt, par)) == \
        accepted(lambda: check_placement(stage, placement, None))


def test_offload_sections():
    z = deepspeed_config(3, offload_optimizer=True, offload_param="nvme",
                         pin_memory=False)["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert z["offload_param"] == {"device": "nvme", "pin_memory": False,
                                  "nvme_path": "/local_nvme"}


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage=4), r"^stage=4 is not a ZeRO stage; allowed: 0, 1, 2, 3"),
    (dict(stage=True), r"^stage=True is not a ZeRO stage"),
    (dict(stage=1.0), r"^stage=1.0 is not a ZeRO stage"),
    (dict(stage=0, offload_optimizer=True), r"offload_optimizer=True needs stage >= 1"),
    (dict(stage=2, offload_param="cpu"), r"offload_param='cpu' needs stage=3"),
    (dict(stage=2, offload_optimizer="nvme"), r"offload_optimizer='nvme' needs stage=3"),
    (dict(stage=3, offload_param="disk"), r"offload_param='disk' is not supported; allowed"),
    (dict(stage=1, offload_optimizer=1), r"offload_optimizer=1 is not supported"),
    (dict(stage=3, offload_param="nvme", nvme_path=""), r"nvme_path='' must be a directory"),
    (dict(stage=1, precision="fp8"), r"precision='fp8' is not supported"),
    (dict(stage=2, reduce_bucket_size=0), r"reduce_bucket_size=0 must be a number > 0"),
    (dict(stage=1, overlap_comm="yes"), r"overlap_comm='yes' is not supported"),
    (dict(stage=1, micro_batch_size=0), r"micro_batch_size=0 must be a whole number >= 1"),
])
def test_bad_input_is_a_message(kwargs, match):
    with pytest.raises(ValueError, match=match):
        deepspeed_config(**kwargs)


def test_pipeline_engine_takes_zero_0_and_1_only():
    assert check_pipeline(0) == 0 and check_pipeline(1) == 1
    for stage in (2, 3):
        with pytest.raises(ValueError, match=r"ZeRO-2 and ZeRO-3 are incompatible with "
                           r"pipeline parallelism.*Allowed with the pipeline engine: 0, 1"):
            check_pipeline(stage)
    with pytest.raises(ValueError, match=r"^stage='2' is not a ZeRO stage"):
        check_pipeline("2")
    assert "deepspeed/runtime/pipe/engine.py" in PIPELINE_WHY


def test_table_rows_are_complete_and_unique():
    rows = key_rows()
    assert len(rows) == len(KEYS) == len(ZERO_KEYS)
    for row in rows:
        assert len(row) == 6 and all(str(cell).strip() for cell in row), row
    # what the issue asks the table to cover
    for key in ("stage", "reduce_scatter", "overlap_comm", "contiguous_gradients",
                "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                "offload_optimizer.device", "offload_optimizer.pin_memory",
                "offload_param.device"):
        assert key in ZERO_KEYS, key


def test_fsdp2_options_named_exist_in_torch():
    """The table names fully_shard's keyword arguments and FSDPModule's methods; each must
    exist in the torch installed (a rename there fails here)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    import torch.distributed.fsdp as fsdp

    text = " ".join(k.fsdp2 for k in KEYS)
    kwargs = set(inspect.signature(fully_shard).parameters)
    for name in set(re.findall(r"\b(\w+)=", text)) - {"full_state_dict", "cpu_offload",
                                                      "pin_memory", "param_dtype",
                                                      "reduce_dtype", "options"}:
        assert name in kwargs, name
    for method in set(re.findall(r"FSDPModule\.(\w+)", text)) | set(
            re.findall(r"\b(set_\w+)", text)):
        assert hasattr(FSDPModule, method), method
    for cls in set(re.findall(r"\b(\w+Policy)\(", text)):
        assert hasattr(fsdp, cls), cls
    for name in ("pin_memory",):
        assert name in inspect.signature(fsdp.CPUOffloadPolicy).parameters
    for name in ("param_dtype", "reduce_dtype"):
        assert name in inspect.signature(fsdp.MixedPrecisionPolicy).parameters


def test_defaults_where_deepspeed_code_departs_from_its_docs():
    """DeepSpeed's deepspeed/runtime/zero/config.py: overlap_comm left out becomes
    `self.stage == ZeroStageEnum.weights` (overlap_comm_valid), though the docs say false;
    prefetch_bucket_size is Field(pp_int(5e7)) while the docs say 5e8; offload_optimizer.ratio
    < 1 asserts "Partial offloading only supported for ZeRO Stage 3." (offload_ratio_check)."""
    from labkit.deepspeed import unset_value

    assert ZERO_KEYS["overlap_comm"].default is False                     # the docs
    assert [unset_value("overlap_comm", s) for s in (1, 2, 3)] == [False, False, True]
    assert ZERO_KEYS["stage3_prefetch_bucket_size"].default == 5e8        # the docs
    assert unset_value("stage3_prefetch_bucket_size", 3) == 5e7           # the code
    assert deepspeed_config(3)["zero_optimization"]["stage3_prefetch_bucket_size"] == 5e7
    assert unset_value("reduce_bucket_size", 2) == 5e8                    # docs = code
    assert ZERO_KEYS["offload_optimizer.ratio"].stages == (3,)
    shown = {row[0]: row[2] for row in key_rows()}
    assert shown["overlap_comm"] == "docs: False; code: False at stages 1, 2; True at stage 3"
    assert shown["stage3_prefetch_bucket_size"] == "docs: 5e8; code: 5e7"
    assert shown["allgather_bucket_size"] == "5e8"
    with pytest.raises(ValueError, match=r"^key='stage3_prefetch_bucket_size' is not a ZeRO key "
                       r"of stage 2; allowed: .*overlap_comm"):
        unset_value("stage3_prefetch_bucket_size", 2)
