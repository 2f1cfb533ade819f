"""Each method's engine registry (``ENGINES`` in ``probfsl.derived.<method>``): one entry
per engine name the estimators accept, and the entries of a method share one interface."""

from __future__ import annotations

import inspect

import pytest
import torch

from probfsl.derived import bavardage, em_dirichlet, evidence, gp_tree, slem
from probfsl.inference.ops import aitken
from probfsl.models.base import ENGINE_NAMES


@pytest.mark.parametrize("module", [bavardage, em_dirichlet, evidence, gp_tree, slem])
def test_every_method_registers_every_engine(module):
    assert tuple(module.ENGINES) == ENGINE_NAMES


@pytest.mark.parametrize("module", [bavardage, em_dirichlet, evidence])
def test_the_engines_of_a_method_take_the_same_arguments(module):
    hand, derived = (module.ENGINES[name] for name in ENGINE_NAMES)
    names = [list(inspect.signature(f).parameters)[:6] for f in (hand, derived)]
    assert len(names[0]) == len(names[1])


def test_aitken_lands_on_the_fixed_point_of_an_affine_map_and_falls_back():
    a0 = torch.tensor([0.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    step = [a0]
    for _ in range(2):  # x <- 0.5 x + 1: fixed point 2
        step.append(0.5 * step[-1] + 1)
    out = aitken(*step)
    torch.testing.assert_close(out[:2], torch.full((2,), 2.0, dtype=torch.float64))
    # at the fixed point the second difference is zero: the last iterate
    assert out[2] == step[2][2]
    # a negative extrapolation of a positive quantity falls back to the last iterate
    a = [torch.tensor([0.2]), torch.tensor([1.0]), torch.tensor([2.0])]
    assert aitken(*a) < 0
    assert aitken(*a, positive=True) == a[2]
    # within rtol of no curvature: the last iterate
    b = [torch.tensor([v], dtype=torch.float64) for v in (1.0, 2.0, 3.0 + 1e-14)]
    assert aitken(*b, rtol=64 * torch.finfo(torch.float64).eps) == b[2]
