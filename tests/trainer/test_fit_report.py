"""The fit report's compile target takes every TPU fact from the one catalog (envspec/tpu.py), which the trainer
image holds beside trainer/: no per-generation table of its own."""

from __future__ import annotations

import dataclasses

import pytest

from envspec import tpu
from trainer.fit.report import Target

SHAPES = [(name, topology) for name, gen in tpu.GENERATIONS.items() for topology in gen.topologies]


@pytest.mark.parametrize(("tpu_type", "topology"), SHAPES, ids=[f"{n}-{t}" for n, t in SHAPES])
def test_a_target_of_every_catalog_shape_has_the_catalogs_figures(tpu_type: str, topology: str) -> None:
    shape = tpu.slice_shape(tpu_type, topology)
    gen = shape.generation
    t = Target.of(shape, 2)
    assert (t.tpu_type, t.topology, t.slices, t.chips_per_slice, t.chips) == (
        tpu_type, topology, 2, shape.chips, 2 * shape.chips)
    assert t.hbm_bytes_per_chip == gen.hbm_gib_per_chip << 30
    assert t.peak_flops_per_chip == gen.peak_bf16_tflops_per_chip * 1e12
    assert t.hbm_bytes_per_s_per_chip == gen.hbm_gbps_per_chip * 1e9
    assert t.dcn_bits_per_s_per_chip == (None if gen.dcn_gbps_per_chip is None else gen.dcn_gbps_per_chip * 1e9)
    assert t.generation is gen
    # The slice's TensorCores: the catalog's count per chip.
    assert int(t.accelerator_type.rsplit("-", 1)[1]) == shape.chips * gen.tensorcores_per_chip
    # A single-host slice names its host's chip grid (libtpu assumes 2x2x1 otherwise); multi-host ones leave it.
    assert (t.host_bounds is None) == shape.multi_host


@pytest.mark.parametrize(("tpu_type", "topology", "accelerator_type"), [
    # Cloud TPU's accelerator types: TensorCores for v4, v5p and Ironwood (2 per chip), chips for v5e and v6e.
    ("v4", "2x2x1", "v4-8"), ("v5e", "2x2", "v5litepod-4"), ("v5p", "2x2x2", "v5p-16"), ("v6e", "4x4", "v6e-16"),
    ("tpu7x", "2x2x1", "tpu7x-8"),
])
def test_accelerator_types_are_cloud_tpus_names(tpu_type: str, topology: str, accelerator_type: str) -> None:
    assert Target.of(tpu.slice_shape(tpu_type, topology), 1).accelerator_type == accelerator_type


def test_the_per_chip_facts_come_from_the_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    # Change the catalog and the target follows: it keeps no copy of its own.
    target = Target("v6e", "2x2", 1, 4, 32 << 30, 918e12, 1638e9)
    assert target.accelerator_type == "v6e-4"
    v6e = tpu.GENERATIONS["v6e"]
    monkeypatch.setitem(tpu.GENERATIONS, "v6e", dataclasses.replace(v6e, tensorcores_per_chip=2,
                                                                     accelerator_type_name="v6lite"))
    assert target.accelerator_type == "v6lite-8"


def test_a_target_names_a_catalog_generation() -> None:
    with pytest.raises(ValueError, match=r"Target: 'v9' is not a TPU catalog name; allowed: tpu7x, v4, v5e"):
        Target("v9", "2x2", 1, 4, 32 << 30, 918e12, 1638e9)
    with pytest.raises(ValueError, match=r"'trillium' is not a TPU catalog name"):  # an alias is not the name
        Target("trillium", "2x2", 1, 4, 32 << 30, 918e12, 1638e9)
