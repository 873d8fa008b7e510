"""Rewrite a tabular_data dataset in place as another writer would: every shard file replaced
(labels flipped, same row counts and row groups; ``fewer``: each file's last row dropped too), then
a new manifest with the new checksums and fingerprint. ``flip(DATASET, fewer)`` from a process
other than the reader's (the test's own, beside a training in its subprocess), or
``python flip_labels.py DATASET [--fewer]``; returns / prints the new fingerprint."""

import json
import os
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.dataset import MANIFEST_NAME
from common.dataset_files import file_entry
from common.manifest_builder import build_manifest, write_manifest
from common.storage import resolve


def flip(root: str, fewer: bool = False) -> str:
    old = json.load(open(os.path.join(root, MANIFEST_NAME)))
    splits = {}
    for split, info in old["splits"].items():
        entries = []
        for entry in info["files"]:
            path = os.path.join(root, entry["path"])
            table = pq.read_table(path)
            groups = list(entry["row_groups"])
            if fewer:
                table, groups[-1] = table.slice(0, table.num_rows - 1), groups[-1] - 1
            table = table.set_column(table.schema.get_field_index("label"), "label",
                                     pc.subtract(pa.scalar(1, pa.int64()), table.column("label")))
            with pq.ParquetWriter(path + ".tmp", table.schema) as writer:
                start = 0
                for size in groups:
                    writer.write_table(table.slice(start, size), row_group_size=max(size, 1))
                    start += size
            os.replace(path + ".tmp", path)  # a new file at the same path, as a rewrite leaves it
            entries.append(file_entry(resolve(root), entry["path"]))
        splits[split] = {"rows": sum(e["rows"] for e in entries), "files": entries}
    manifest = build_manifest(splits, old["features"], old["label"], config={})
    write_manifest(resolve(root), manifest)
    return manifest["fingerprint"]


if __name__ == "__main__":
    print(flip(sys.argv[1], fewer="--fewer" in sys.argv[2:]))
