"""The demo (the README's first command) trains every part to its accuracy target on CPU."""

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("optax")

from jaxdnn import demo  # noqa: E402


@pytest.mark.parametrize("part", list(demo.PARTS))
def test_demo_part_reaches_its_target(part):
    result = demo.PARTS[part](demo.parse_args(["--epochs", "5", "--parts", part]))
    assert result.ok, f"{part}: test accuracy {result.test_accuracy:.3f} below {result.target}"
