"""`Linear`'s CPU paths (small-batch packed kernel, oneDNN bf16, F.linear) all compute `x @ weight.T`."""

import pytest
import torch
import torch.nn.functional as F

from spindle_attention import cpu
from spindle_model.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_paths_agree(dtype):
    g = torch.Generator().manual_seed(0)
    layer = Linear(200, 96, dtype)
    layer.weight.copy_(torch.randn(200, 96, generator=g))
    layer.pack()
    for rows in (1, 7, cpu.MAX_ROWS, cpu.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        tol = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), **tol)
    assert (layer.small._packed is not None) == cpu.available()


def test_reloading_weights_repacks():
    layer = Linear(64, 32, torch.float32)
    layer.weight.copy_(torch.ones(64, 32))
    layer.pack()
    x = torch.ones(2, 32)
    assert torch.all(layer(x) == 32)
    layer.weight.copy_(2 * torch.ones(64, 32))
    layer.pack()
    assert torch.all(layer(x) == 64)
