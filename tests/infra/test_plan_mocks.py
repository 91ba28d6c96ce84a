"""The offline plan marks what it made up (GKE versions, API endpoints, the built image's digest), so a reviewer does
not take a stand-in for what `pulumi up` will get; a prebuilt image's digest is the user's own and is not marked."""

from __future__ import annotations

import copy

from infra.offline import render
from infra.offline.mockrun import run_stack
from tests.infra.conftest import stack_config


def test_mock_values_are_marked() -> None:
    result = run_stack("prod", stack_config("prod"))
    text = render.text(result)
    assert "minVersion=1.34.99-gke.99999 (mock)" in text
    assert "clusterEndpoint: gke-mock-rl-prod.mock.gke.goog.invalid (mock)" in text
    [image_line] = [line for line in text.splitlines() if line.strip().startswith("trainerImage:")]
    assert image_line.endswith("(mock)")
    assert render.MOCK_LEGEND in text and render.MOCK_LEGEND in render.markdown(result)
    assert "`clusterName`: `rl-prod`\n" in render.markdown(result)  # a real value stays unmarked


def test_a_prebuilt_images_digest_is_not_a_mock() -> None:
    config = copy.deepcopy(stack_config("staging"))
    digest = "registry.example/trainer@sha256:" + "ab" * 32
    config["gke-tpu-rl:trainer"] = {**config["gke-tpu-rl:trainer"], "image": digest}
    text = render.text(run_stack("staging", config))
    assert f"trainerImage: {digest}\n" in text
    assert f"image={digest}  " in text or f"image={digest}\n" in text
