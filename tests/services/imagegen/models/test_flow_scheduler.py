"""Our schedule equals diffusers' `FlowMatchEulerDiscreteScheduler` set up as the reference pipeline does
(ming.md §6.3): built from scheduler_config.json, `sigma_min = 0`, `set_timesteps(steps, mu)` with mu from
the image token count; and one Euler step equals `scheduler.step` on the negated model output."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from omnistage.common.checkpoint.tiny_imagegen import SCHEDULER
from omnistage.services.imagegen.models.config import SchedulerConfig
from omnistage.services.imagegen.models.scheduler import calculate_shift, make_schedule

# diffusers' exponential time shift divides by the final sigma 0 (→ 0 exactly, with a numpy warning).
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def _reference(config: dict, steps: int, seq_len: int) -> FlowMatchEulerDiscreteScheduler:
    sched = FlowMatchEulerDiscreteScheduler.from_config(config)
    sched.config["use_dynamic_shifting"] = True  # what the reference pipeline writes (see below)
    sched.sigma_min = 0.0
    mu = calculate_shift(seq_len, SchedulerConfig())  # the same linear rule as diffusers' pipelines
    sched.set_timesteps(steps, mu=mu)
    return sched


def _ours(config: dict) -> SchedulerConfig:
    return SchedulerConfig(**{k: v for k, v in config.items() if not k.startswith("_")})


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize(("steps", "seq_len"), [(30, 4096), (30, 1024), (8, 256), (1, 4096), (50, 8192)])
def test_sigmas_and_timesteps_equal_diffusers(dynamic, steps, seq_len):
    config = {**SCHEDULER, "use_dynamic_shifting": dynamic}
    ref = _reference(config, steps, seq_len)
    ours = make_schedule(_ours(config), steps, seq_len)
    assert torch.equal(ours.sigmas, ref.sigmas.float()), (ours.sigmas, ref.sigmas)
    assert torch.equal(ours.timesteps, ref.timesteps.float())
    assert ours.sigmas[0] == 1.0 and ours.sigmas[-1] == 0.0
    if steps > 1:
        assert ours.sigmas[-2] == 0.0  # sigma_min 0: the last step goes from 0 to 0


def test_dynamic_shift_depends_on_the_image_size():
    cfg = _ours(SCHEDULER)
    small, large = make_schedule(cfg, 10, 256), make_schedule(cfg, 10, 4096)
    assert (large.sigmas[1:-2] > small.sigmas[1:-2]).all()  # more tokens, more time at high noise
    assert calculate_shift(256, cfg) == pytest.approx(0.5) and calculate_shift(4096, cfg) == pytest.approx(
        1.15
    )


def test_the_file_flag_decides_the_shift():
    """The reference's run-time `config["use_dynamic_shifting"] = True` stores a dict item that
    `set_timesteps` never reads (it reads the FrozenDict attribute): a file with the flag off keeps the
    static shift, and so does our schedule."""
    config = {**SCHEDULER, "use_dynamic_shifting": False, "shift": 3.0}
    ref = _reference(config, 12, 4096)
    assert torch.equal(make_schedule(_ours(config), 12, 4096).sigmas, ref.sigmas.float())
    dynamic = make_schedule(_ours({**config, "use_dynamic_shifting": True}), 12, 4096)
    assert not torch.equal(dynamic.sigmas, ref.sigmas.float())


def test_euler_step_equals_scheduler_step():
    config = dict(SCHEDULER)
    ref = _reference(config, 6, 1024)
    ours = make_schedule(_ours(config), 6, 1024)
    gen = torch.Generator().manual_seed(0)
    x_ref = x_ours = torch.randn(1, 16, 8, 8, generator=gen)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(1, 16, 8, 8, generator=gen)
        x_ref = ref.step(-v, t, x_ref, return_dict=False)[0]
        x_ours = x_ours + ours.dt(i) * (-v)
        assert ours.model_time(i) == (1000 - t.expand(1)) / 1000
    assert torch.equal(x_ours, x_ref)


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match="use_karras_sigmas=True is not supported"):
        SchedulerConfig(unsupported={"use_karras_sigmas": True})
    with pytest.raises(ValueError, match="steps must be >= 1"):
        make_schedule(SchedulerConfig(), 0, 256)
