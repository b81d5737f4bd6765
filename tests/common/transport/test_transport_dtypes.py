import pytest
import torch
from omnistage.common.transport import SUPPORTED_DTYPES, from_proto_dtype, to_proto_dtype
from omnistage.v1 import tensor_pb2


def test_every_proto_dtype_maps_back_and_forth():
    proto_values = [v for v in tensor_pb2.DType.values() if v != tensor_pb2.DTYPE_UNSPECIFIED]
    assert sorted(to_proto_dtype(d) for d in SUPPORTED_DTYPES) == sorted(proto_values)
    for dtype in SUPPORTED_DTYPES:
        assert from_proto_dtype(to_proto_dtype(dtype)) is dtype


def test_names_match_between_torch_and_proto():
    for dtype in SUPPORTED_DTYPES:
        proto_name = tensor_pb2.DType.Name(to_proto_dtype(dtype))
        assert proto_name == "DTYPE_" + str(dtype).removeprefix("torch.").upper()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn, torch.uint16])
def test_unsupported_dtype_is_a_clear_error(dtype):
    with pytest.raises(TypeError, match="does not support dtype"):
        to_proto_dtype(dtype)


@pytest.mark.parametrize("value", [tensor_pb2.DTYPE_UNSPECIFIED, 99])
def test_unusable_proto_dtype_is_a_clear_error(value):
    with pytest.raises(TypeError, match="no usable dtype"):
        from_proto_dtype(value)
