"""The request decoder against anything a client can send (issue 40): a tensor whose bytes, indices or shape lie
must fail its request with a ValueError naming what is wrong, before anything is allocated, and every tensor the SDK
itself encodes (dense or sparse CSR, every dtype) must decode to what the SDK's own `to_numpy()` gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import _tensor_data_to_proto, forward_backward_request_to_proto

from trainer.service import protocol

DTYPES = [pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16, 0, 99]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor:
    """Any Tensor message: shapes that may be huge or negative, byte strings of any length, CSR parts that may
    disagree with each other or the shape."""
    t = pb.Tensor(dtype=draw(st.sampled_from(DTYPES)))
    t.shape.extend(draw(st.lists(st.one_of(st.integers(-2, 6), st.integers(2**19, 2**40)), max_size=3)))
    if draw(st.booleans()):
        t.dense = draw(st.binary(max_size=64))
    else:
        ints = st.lists(st.integers(-3, 2**40), max_size=8)
        t.sparse_csr.values = draw(st.binary(max_size=64))
        t.sparse_csr.crow_indices = np.asarray(draw(ints), np.int64).tobytes()
        t.sparse_csr.col_indices = np.asarray(draw(ints), np.int64).tobytes()
    return t


@SETTINGS
@given(tensors())
def test_any_tensor_decodes_to_its_shape_or_fails_with_a_value_error(t: pb.Tensor) -> None:
    try:
        arr = protocol.tensor_to_numpy(t)
    except ValueError as e:
        assert str(e)
        return
    assert arr.size <= protocol.MAX_TENSOR_ELEMENTS
    if t.shape:
        assert list(arr.shape) == list(t.shape)


@st.composite
def sdk_tensors(draw: st.DrawFn) -> types.TensorData:
    """What the SDK sends: TensorData from an array, dense or as sparse CSR (its `from_torch_sparse` layout)."""
    dtype = draw(st.sampled_from(["float32", "int64"]))
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    mask = np.array(draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))).reshape(rows, cols)
    values = np.arange(1, rows * cols + 1).reshape(rows, cols).astype(dtype) * mask
    if draw(st.booleans()):
        return types.TensorData.from_numpy(values)
    crow = np.concatenate([[0], np.cumsum(mask.sum(axis=1))]).tolist()
    col = np.nonzero(mask)[1].tolist()
    return types.TensorData(data=values[mask].tolist(), dtype=dtype, shape=[rows, cols], sparse_crow_indices=crow,
                            sparse_col_indices=col)


@SETTINGS
@given(sdk_tensors())
def test_what_the_sdk_encodes_decodes_as_the_sdk_reads_it(td: types.TensorData) -> None:
    np.testing.assert_array_equal(protocol.tensor_to_numpy(_tensor_data_to_proto(td)), td.to_numpy())


def _body(weights: pb.Tensor) -> bytes:
    msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})], loss_fn="cross_entropy"),
        model_id="m", seq_id=1))
    msg.data[0].loss_fn_inputs["weights"].CopyFrom(weights)
    return protocol.canonical_forward_backward(msg)


def _sparse(shape: list[int], crow: list[int], cols: list[int], values: list[float]) -> pb.Tensor:
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32)
    t.shape.extend(shape)
    t.sparse_csr.values = np.asarray(values, np.float32).tobytes()
    t.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
    t.sparse_csr.col_indices = np.asarray(cols, np.int64).tobytes()
    return t


@pytest.mark.parametrize(("weights", "says"), [
    # The issue's two requests: a column index out of range (IndexError) and a 4 TiB shape (an allocation).
    (_sparse([1, 3], [0, 1], [7], [1.0]), r"col_indices must be in \[0, 3\)"),
    (_sparse([2**20, 2**20], [0], [], []), r"shape \[1048576, 1048576\] has 1099511627776 elements"),
    (_sparse([1, 3], [0, 2], [0], [1.0]), "crow_indices must rise from 0 to the 1 values"),
])
def test_the_issues_requests_fail_with_the_field_named(weights: pb.Tensor, says: str) -> None:
    with pytest.raises(ValueError, match=rf"datum 0: loss_fn_inputs\['weights'\]: .*{says}"):
        protocol.decode_forward_backward(_body(weights))


def test_token_bytes_that_are_not_int32_ids_fail() -> None:
    msg: Any = pb.ForwardBackwardRequest()
    msg.ParseFromString(_body(_sparse([1, 3], [0, 1], [0], [1.0])))
    msg.data[0].model_input[0].encoded_text.tokens = b"\x01\x02\x03"
    with pytest.raises(ValueError, match="datum 0: model_input tokens are 3 bytes"):
        protocol.decode_forward_backward(msg.SerializeToString())
