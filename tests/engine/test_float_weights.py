"""OnDemandWeights: parameters loaded while held, released when idle, C pointers kept right."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.float_weights import OnDemandWeights, releasable


class _Bound:
    """Record rebind/unbind calls, as engine.native.BoundStep receives them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def rebind(self) -> None:
        self.calls.append("rebind")

    def unbind(self) -> None:
        self.calls.append("unbind")


def _model() -> nn.Module:
    m = nn.Module()
    m.a = nn.Parameter(torch.arange(6.0).reshape(2, 3), requires_grad=False)
    m.b = nn.Parameter(torch.ones(3), requires_grad=False)
    return m


def test_weights_reload_once_for_every_holder_and_go_when_the_last_lets_go() -> None:
    m, bound = _model(), _Bound()
    loads: list[int] = []

    def reload() -> dict[str, torch.Tensor]:
        loads.append(1)
        return {"a": torch.arange(6.0).reshape(2, 3)}

    w = OnDemandWeights(m, ["a"], reload, hold_s=0.0, bound=[bound])
    assert w.nbytes == 6 * 4 and w.release_idle()
    assert m.a.numel() == 0 and m.b.numel() == 3 and bound.calls == ["unbind"]
    with w.held() as first, w.held() as second:
        assert first >= 0.0 and second == 0.0  # the second holder found them resident
        assert torch.equal(m.a, torch.arange(6.0).reshape(2, 3))
    assert len(loads) == 1 and w.reloads == 1
    # hold_s 0: released as the last holder let go, C unbound before the memory went.
    assert not w.resident and m.a.numel() == 0
    assert bound.calls == ["unbind", "rebind", "unbind"]


def test_a_reload_that_does_not_fit_is_refused_and_leaves_them_released() -> None:
    m = _model()
    w = OnDemandWeights(m, ["a"], lambda: {"a": torch.zeros(3, 2)}, hold_s=0.0)
    w.release_idle()
    with pytest.raises(RuntimeError, match=r"a: expected \(2, 3\)"):
        w.acquire()
    assert not w.resident and m.a.numel() == 0
    with pytest.raises(RuntimeError):  # nobody holds them: the next request tries again
        w.acquire()


def test_only_parameters_nothing_else_holds_are_releasable() -> None:
    m = _model()
    m.tied = m.b  # the same tensor under another name: releasing it frees nothing
    other = nn.Module()
    other.shared = m.a
    assert releasable(m, ["a", "b"], keep=[other]) == []
    assert releasable(m, ["a"], keep=[]) == ["a"]
