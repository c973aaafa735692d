"""Engine arguments from --engine-config FILE and --engine-arg key=value: values parse as TOML
scalars, flags override the file, unknown keys are refused with the valid ones named before
anything connects or loads a model. Needs neither vLLM nor torch (without vLLM the keys are
checked against the documented allow-list, engine_config.VLLM_ARGS)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from typer.testing import CliRunner

from staleflow_cli.main import app
from workers.rollout.engines import engine_config as ec


@pytest.mark.parametrize(
    "text, value",
    [("2", 2), ("0.85", 0.85), ("true", True), ("false", False), ('"auto"', "auto"), ("bfloat16", "bfloat16")],
)
def test_values_parse_as_toml_scalars(text, value):
    assert ec.parse_value(text) == value and type(ec.parse_value(text)) is type(value)


@pytest.mark.parametrize("bad", ["[1, 2]", "{a = 1}", "", 'x"y'])
def test_non_scalars_are_refused(bad):
    with pytest.raises(ec.EngineConfigError):
        ec.parse_value(bad)


def test_flags_override_the_file_and_dashes_become_underscores(tmp_path):
    f = tmp_path / "engine.toml"
    f.write_text('tensor_parallel_size = 2\ndtype = "bfloat16"\ngpu_memory_utilization = 0.9\n')
    cfg = ec.engine_config(f, ["gpu-memory-utilization=0.5", "enforce_eager=true", "max_model_len=4096"])
    assert cfg == {
        "tensor_parallel_size": 2,
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "enforce_eager": True,
        "max_model_len": 4096,
    }
    # an [engine] table (as in a launch config) reads the same
    f.write_text("[engine]\ntensor_parallel_size = 2\n")
    assert ec.engine_config(f) == {"tensor_parallel_size": 2}


def test_bad_file_and_bad_flag_name_the_problem(tmp_path):
    f = tmp_path / "engine.toml"
    f.write_text("dtype = \n")
    with pytest.raises(ec.EngineConfigError, match="not valid TOML"):
        ec.engine_config(f)
    with pytest.raises(ec.EngineConfigError, match="cannot read"):
        ec.engine_config(tmp_path / "missing.toml")
    with pytest.raises(ec.EngineConfigError, match="key=value"):
        ec.engine_config(None, ["enforce_eager"])


def test_unknown_vllm_keys_are_refused_with_the_valid_ones():
    with pytest.raises(ec.EngineConfigError) as e:
        ec.check_vllm({"tensor_paralel_size": 2}, fields=ec.VLLM_ARGS)
    msg = str(e.value)
    assert "'tensor_paralel_size'" in msg and "did you mean 'tensor_parallel_size'" in msg
    assert all(k in msg for k in ec.VLLM_ARGS)
    for key in ec.VLLM_RESERVED:
        with pytest.raises(ec.EngineConfigError, match=f"{key!r} cannot be set"):
            ec.check_vllm({key: "x"}, fields=ec.VLLM_ARGS | {key})


def test_the_config_wins_over_max_running():
    assert ec.vllm_kwargs({}, 64) == {"max_num_seqs": 64}
    assert ec.vllm_kwargs({"max_num_seqs": 8, "tensor_parallel_size": 2}, 64) == {
        "max_num_seqs": 8,
        "tensor_parallel_size": 2,
    }


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (`make test-vllm`)")
def test_the_allow_list_is_a_subset_of_vllms_engine_args():
    from vllm import AsyncEngineArgs

    assert ec.VLLM_ARGS <= {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert ec.vllm_fields() == frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def test_hf_engine_maps_what_applies_and_refuses_the_rest():
    assert ec.hf_kwargs({"dtype": "bfloat16", "device": "cuda:1", "max_model_len": 512, "max_num_seqs": 4}) == {
        "dtype": "bfloat16",
        "device": "cuda:1",
        "max_len": 512,
        "max_running": 4,
    }
    with pytest.raises(ec.EngineConfigError, match="does not take engine argument 'tensor_parallel_size'"):
        ec.hf_kwargs({"tensor_parallel_size": 2})
    with pytest.raises(ec.EngineConfigError, match="dtype 'auto'"):
        ec.hf_kwargs({"dtype": "auto"})
    with pytest.raises(ec.EngineConfigError, match="'max_model_len' must be a positive integer"):
        ec.hf_kwargs({"max_model_len": 0})


def _cli(args):
    res = CliRunner().invoke(app, args, env={"COLUMNS": "300", "STALEFLOW_TOKEN": "", "STALEFLOW_API_URL": ""})
    return res.exit_code, " ".join((res.stdout + res.stderr).split())


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--engine", "vllm", "--vllm-model", "m", "--engine-arg", "tensor_paralel_size=2"], "did you mean"),
        (["--engine", "vllm", "--vllm-model", "m", "--engine-arg", "model=x"], "'model' cannot be set"),
        (["--engine", "hf", "--model", "/nonexistent", "--engine-arg", "enforce_eager=true"], "does not take"),
        (["--engine", "sim", "--engine-arg", "dtype=float16"], "apply to the vllm and hf engines"),
        (["--engine", "vllm", "--vllm-model", "m", "--engine-config", "/nonexistent.toml"], "cannot read"),
    ],
)
def test_the_rollout_worker_refuses_bad_engine_arguments_before_connecting(extra, needle):
    code, out = _cli(["rollout-worker", "--run", "1", *extra])
    assert code == 2 and needle in out, out
