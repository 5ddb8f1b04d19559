"""Real-world objectives written as graphs (`expr`), run through the graph executor and
compared with the same objective in PyTorch: values and gradients, float64."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.engine.graph import GraphSpec, TensorSpec, compile_graph, execute
from tests.support.objectives import OBJECTIVES, objective_data, torch


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_matches_torch(name: str) -> None:
    nodes, output, wrt, reference = OBJECTIVES[name]
    data = objective_data()
    specs = {k: TensorSpec(v.shape, str(v.dtype), k in wrt) for k, v in data.items()}
    program = compile_graph(GraphSpec(nodes=nodes, outputs=[output]), specs, backward=True)
    result = execute(program, data, verify=True)

    ref_in = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in data.items()}
    ref = reference(ref_in)
    ref.backward()
    ours = result.outputs[output]
    np.testing.assert_allclose(ours, ref.detach().numpy(), rtol=1e-9, atol=1e-12)
    assert result.gradients is not None
    assert set(result.gradients) == set(wrt)
    for k in wrt:
        np.testing.assert_allclose(
            result.gradients[k], ref_in[k].grad.numpy(), rtol=1e-8, atol=1e-10, err_msg=k
        )
    assert result.peak_bytes == result.planned_peak_bytes
