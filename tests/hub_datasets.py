"""Small local data sets published offline under a Hub dataset's name, for recipes that load one by name.

`publish_dataset(hf_home, repo_id, splits)` writes `splits` ({split: rows}) as the `datasets` library's own cache
entry of `repo_id` (HF_HOME/datasets/{org}___{name}/{config}/0.0.0/<hash>/: dataset_info.json and one Arrow stream
file per split, as `load_dataset` leaves them after a download). With HF_HOME=hf_home and HF_HUB_OFFLINE=1,
`datasets.load_dataset(repo_id)` cannot reach the Hub and reloads that entry ("Using the latest cached version of
the dataset", datasets/load.py CachedDatasetModuleFactory), so a recipe that hard-codes a Hub dataset runs
unchanged on these rows, the way tests/tiny_model.py lets it load a tokenizer by name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def publish_dataset(hf_home: Path, repo_id: str, splits: dict[str, list[dict[str, Any]]],
                    config_name: str = "default") -> Path:
    """Write `splits` as the cached copy of dataset `repo_id` (its configuration `config_name`, which
    `load_dataset(repo_id, config_name)` asks for; `load_dataset(repo_id)` finds "default") under hf_home and return
    its directory."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from datasets.naming import camelcase_to_snakecase, filename_prefix_for_split

    org, name = repo_id.split("/")
    digest = hashlib.sha256(json.dumps(splits, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(hf_home) / "datasets" / f"{org}___{camelcase_to_snakecase(name)}" / config_name / "0.0.0"
    out = root / digest
    out.mkdir(parents=True, exist_ok=True)
    split_dict = datasets.SplitDict(dataset_name=name)
    features = None
    for split, rows in splits.items():
        table = datasets.Dataset.from_list(rows)
        features = table.features
        with ArrowWriter(path=str(out / f"{filename_prefix_for_split(name, split)}.arrow")) as writer:
            writer.write_table(table.data.table)
            count, nbytes = writer.finalize()
        split_dict.add(datasets.SplitInfo(name=split, num_bytes=nbytes, num_examples=count, dataset_name=name))
    info = datasets.DatasetInfo(features=features, splits=split_dict, config_name=config_name, dataset_name=name,
                                version="0.0.0")
    info.write_to_directory(str(out))
    return out
