"""A service's name leaves room for the child names it makes (spec.check_name), as the CRD's rules do."""

from __future__ import annotations

import pytest

from tally_operator.autoscale import Autoscaling
from tally_operator.spec import PoolConfig, Spec, SpecError, check_name

PLAIN = Spec(model_name="m")
AT_ZERO = Spec(model_name="m",
               autoscaling=Autoscaling(min_replicas=0, max_replicas=2, metric="queuedRequests", target=4))
ROUTED = Spec(model_name="m", pool=PoolConfig())
ROUTED_TO_A_GIVEN_PICKER = Spec(model_name="m", pool=PoolConfig(picker="shared-epp"))


@pytest.mark.parametrize(("length", "spec", "fits"), [
    pytest.param(63, PLAIN, True, id="a plain service: 63"),
    pytest.param(58, AT_ZERO, True, id="scale to zero: <name>-pods at 63"),
    pytest.param(59, AT_ZERO, False, id="scale to zero: <name>-pods at 64"),
    pytest.param(59, ROUTED, True, id="routed: <name>-epp at 63"),
    pytest.param(60, ROUTED, False, id="routed: <name>-epp at 64"),
    pytest.param(63, ROUTED_TO_A_GIVEN_PICKER, True, id="routed to a picker of its own: no <name>-epp"),
])
def test_the_longest_child_name_decides(length: int, spec: Spec, fits: bool) -> None:
    name = "s" * length
    if fits:
        check_name(name, spec)
        return
    with pytest.raises(SpecError) as refused:
        check_name(name, spec)
    assert refused.value.reason == "NameTooLong" and str(length - 1) in refused.value.message
