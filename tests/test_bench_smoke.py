"""bench/bench_compiled.py's workloads are right: gradserve, the hand-written NumPy and the
PyTorch eager versions agree on the value and every gradient (small sizes; no timing)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from bench import bench_compiled as bc

WORKLOADS = bc.small_workloads()


@pytest.fixture(scope="module")
def gs() -> bc.Gradserve:
    return bc.Gradserve()


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_implementations_agree(workload: bc.Workload, gs: bc.Gradserve) -> None:
    baselines = [impl for impl in (workload.numpy, workload.torch) if impl is not None]
    assert baselines, "nothing to compare gradserve with"
    bc.check(workload, gs)  # raises AssertionError on any disagreement


def test_check_catches_a_wrong_gradient(gs: bc.Gradserve) -> None:
    w = bc.gmm(2, 3, 10)
    numpy_gmm = w.numpy
    assert numpy_gmm is not None

    def wrong(inputs: bc.Arrays) -> tuple[np.ndarray, bc.Arrays]:
        value, grads = numpy_gmm(inputs)
        return value, {**grads, "means": grads["means"] * 1.001}

    w.numpy = wrong
    with pytest.raises(AssertionError, match="means"):
        bc.check(w, gs)


def test_objectives_are_the_tests_objectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies in the bench still say what tests/test_objectives.py says."""
    tests = pytest.importorskip("tests.test_objectives")
    assert set(bc.OBJECTIVES) == set(tests.OBJECTIVES)
    monkeypatch.setattr(tests, "RNG", np.random.default_rng(42))  # its first draws
    data = bc.objectives_data()
    for k, v in tests._data().items():
        np.testing.assert_array_equal(data[k], v, err_msg=k)
    for name, (nodes, output, wrt) in bc.OBJECTIVES.items():
        theirs, their_output, their_wrt, _ = tests.OBJECTIVES[name]
        assert (output, wrt) == (their_output, their_wrt), name
        ours = [(n["id"], n.get("op"), list(n.get("args", ())), n.get("attrs", {}),
                 n.get("expr")) for n in nodes]
        assert ours == [(n.id, n.op, list(n.args), dict(n.attrs), n.expr) for n in theirs], name


def test_transform_benchmarks_agree_with_torch() -> None:
    """bench/bench_transforms.py: the scan, the unrolled loop and PyTorch agree on the RNN's
    gradients, and every objective's in-graph HVP and JVP on PyTorch's double backward and
    torch.func.jvp."""
    from bench import bench_transforms as bt

    bt.check_rnn(steps=20)
    for name in bt.OBJECTIVES:
        bt.check_hvp(name)
        bt.check_jvp(name)
