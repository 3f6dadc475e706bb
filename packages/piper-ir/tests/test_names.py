import pytest

from piper_ir import (
    Phase,
    Sharding,
    ShardKind,
    backward_halves,
    compute_id,
    event_id,
    from_json,
    grad_name,
    grad_of,
    is_grad,
    microbatch_id,
    to_json,
    transfer_ids,
)


def test_gradient_names_round_trip():
    assert grad_name("v:h") == "grad:v:h"
    assert is_grad(grad_name("v:h")) and not is_grad("v:h")
    assert grad_of(grad_name("v:h")) == "v:h"
    with pytest.raises(ValueError, match="not a gradient"):
        grad_of("v:h")


def test_node_ids_are_spelled_as_serialized_programs_hold_them():
    """Byte for byte what the compiler wrote before the helpers existed (programs and tests hold them)."""
    assert compute_id(Phase.F, "s0") == "F.s0"
    assert compute_id(Phase.OPT, "s3") == "OPT.s3"
    assert compute_id(Phase.B, "loss", 2) == "B.loss.mb2"
    assert microbatch_id("F.s0", 0) == "F.s0.mb0" and microbatch_id("F.s0", None) == "F.s0"
    assert backward_halves("B.s1.mb0") == ("BI.s1.mb0", "BW.s1.mb0")
    assert backward_halves("custom") == ("BI.custom", "BW.custom")
    assert transfer_ids("v:s0", 1, (0,), (1,)) == ("send.v:s0.mb1.0-1", "recv.v:s0.mb1.0-1")
    assert transfer_ids("grad:v:s0", None, (2, 3), (0, 1)) == ("send.grad:v:s0.2_3-0_1", "recv.grad:v:s0.2_3-0_1")
    assert event_id("F.s0.mb0") == "ev.F.s0.mb0"


def test_shard_kind_is_an_enum_that_reads_plain_strings():
    sh = Sharding("s0", (0, 1), "ep", 2)
    assert sh.kind is ShardKind.EP
    assert from_json(to_json(sh)) == sh
    with pytest.raises(ValueError):
        Sharding("s0", (0, 1), "xp", 2)
