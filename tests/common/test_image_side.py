import pytest
from omnistage.common.image_side import check_image_side
from omnistage.common.runtime.errors import InvalidRequest


def test_a_side_on_the_grid_and_in_range_is_returned():
    assert check_image_side("width", 512, 16, 64, 1024, "limits") == 512
    assert check_image_side("width", 64, 16, 64, 1024, "limits") == 64  # both ends are allowed
    assert check_image_side("width", 1024, 16, 64, 1024, "limits") == 1024


@pytest.mark.parametrize(
    "value, message",
    [
        (100, "image.height: 100 is not a multiple of 16"),
        (48, "image.height: 48 is outside [64, 1024] (the stage's limits)"),
        (1040, "image.height: 1040 is outside [64, 1024] (the stage's limits)"),
    ],
)
def test_a_side_off_the_grid_or_out_of_range_names_the_field_and_whose_limits(value, message):
    with pytest.raises(InvalidRequest) as err:
        check_image_side("image.height", value, 16, 64, 1024, "the stage's limits")
    assert str(err.value) == message
