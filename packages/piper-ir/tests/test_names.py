import pytest

from piper_ir import Sharding, ShardKind, from_json, grad_name, grad_of, is_grad, to_json


def test_gradient_names_round_trip():
    assert grad_name("v:h") == "grad:v:h"
    assert is_grad(grad_name("v:h")) and not is_grad("v:h")
    assert grad_of(grad_name("v:h")) == "v:h"
    with pytest.raises(ValueError, match="not a gradient"):
        grad_of("v:h")


def test_shard_kind_is_an_enum_that_reads_plain_strings():
    sh = Sharding("s0", (0, 1), "ep", 2)
    assert sh.kind is ShardKind.EP
    assert from_json(to_json(sh)) == sh
    with pytest.raises(ValueError):
        Sharding("s0", (0, 1), "xp", 2)
