"""`staleflow trainer` parses its flags into one TrainerOptions: the lr schedule and the GRPO
loss settings come from it, and a contradictory set is refused before anything connects."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.trainer.options import SimOptions, TrainerOptions


def test_lr_decays_linearly_to_lr_end_at_the_last_step_then_stays():
    scale = TrainerOptions(steps=5, lr_end=0.2).lr_scale()
    assert scale is not None
    assert [round(scale(v), 6) for v in range(7)] == [1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2]


def test_no_decay_means_no_schedule():
    assert TrainerOptions().lr_scale() is None


def test_lr_end_without_steps_is_refused():
    with pytest.raises(ValueError, match="--lr-end decays over --steps"):
        TrainerOptions(lr_end=0.1)


def test_grpo_settings_come_from_the_options_and_tis_cap_zero_disables_tis():
    pytest.importorskip("torch")
    grpo = TrainerOptions(clip_low=0.1, clip_high=0.3, tis_cap=0.0, temperature=0.7).grpo()
    assert (grpo.clip_low, grpo.clip_high, grpo.tis_cap, grpo.temperature) == (0.1, 0.3, None, 0.7)


def test_the_command_refuses_lr_end_without_steps_before_reaching_the_api():
    # no API listens at this address: the refusal must come first, as a usage error (exit 2)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "staleflow_cli.main",
            "trainer",
            "--run",
            "1",
            "--sim",
            "--lr-end",
            "0.5",
            "--api",
            "http://127.0.0.1:9",
            "--api-wait",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--lr-end decays over --steps" in proc.stderr


def test_sim_options_are_frozen_values():
    assert SimOptions(2.0, None, 0.5) == SimOptions(time_scale=2.0, s_per_token=0.5)


def test_push_dtype_is_bf16_on_a_gpu_the_parameters_own_on_a_cpu_unless_named():
    assert TrainerOptions(device="cuda").push_dtype_name() == "bfloat16"
    assert TrainerOptions(device="cuda:1").push_dtype_name() == "bfloat16"
    assert TrainerOptions(device="cpu").push_dtype_name() is None
    assert TrainerOptions(device="cuda", push_dtype="float32").push_dtype_name() == "float32"
    with pytest.raises(ValueError, match="--push-dtype 'int8'"):
        TrainerOptions(push_dtype="int8")
